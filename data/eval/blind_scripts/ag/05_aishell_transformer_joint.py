#!/usr/bin/env python
# Joint CTC/attention Transformer on AISHELL-1 (character units), ESPnet-like recipe.
import argparse
import logging
import math
import os
from pathlib import Path

import editdistance
import kaldiio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE_ID = -1


class KaldiDataset(Dataset):
    """feats.scp + text (utt-id keyed), features already extracted with CMVN applied."""

    def __init__(self, data_dir, token2id):
        feats = dict(l.split(maxsplit=1) for l in open(Path(data_dir) / "feats.scp").read().splitlines())
        texts = dict(l.split(maxsplit=1) for l in open(Path(data_dir) / "text").read().splitlines()
                     if len(l.split(maxsplit=1)) == 2)
        self.keys = sorted(k for k in feats if k in texts)
        self.feats = feats
        self.texts = texts
        self.token2id = token2id
        self.unk = token2id["<unk>"]

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        k = self.keys[i]
        x = torch.from_numpy(kaldiio.load_mat(self.feats[k].strip())).float()
        y = torch.tensor([self.token2id.get(c, self.unk) for c in self.texts[k].replace(" ", "")])
        return x, y


def collate(batch):
    xs, ys = zip(*batch)
    xl = torch.tensor([x.size(0) for x in xs])
    yl = torch.tensor([y.size(0) for y in ys])
    xs = nn.utils.rnn.pad_sequence(xs, batch_first=True)
    ys = nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=IGNORE_ID)
    return xs, xl, ys, yl


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)
        self.scale = math.sqrt(d)

    def forward(self, x):
        return x * self.scale + self.pe[:, : x.size(1)]


class JointCTCAttention(nn.Module):
    def __init__(self, idim, odim, adim=256, heads=4, elayers=12, dlayers=6, units=2048, ctc_weight=0.3, lsm=0.1):
        super().__init__()
        self.sos = self.eos = odim - 1
        self.odim = odim
        self.ctc_weight = ctc_weight
        self.lsm = lsm
        self.conv = nn.Sequential(nn.Conv2d(1, adim, 3, 2), nn.ReLU(), nn.Conv2d(adim, adim, 3, 2), nn.ReLU())
        self.conv_out = nn.Linear(adim * (((idim - 1) // 2 - 1) // 2), adim)
        self.pos = PositionalEncoding(adim)
        enc_layer = nn.TransformerEncoderLayer(adim, heads, units, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, elayers, norm=nn.LayerNorm(adim))
        self.embed = nn.Embedding(odim, adim)
        dec_layer = nn.TransformerDecoderLayer(adim, heads, units, 0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(dec_layer, dlayers, norm=nn.LayerNorm(adim))
        self.dec_out = nn.Linear(adim, odim)
        self.ctc_lo = nn.Linear(adim, odim)

    def encode(self, xs, xl):
        x = self.conv(xs.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.pos(self.conv_out(x.transpose(1, 2).reshape(b, t, c * f)))
        hl = ((xl - 1) // 2 - 1) // 2
        mask = torch.arange(t, device=x.device)[None, :] >= hl[:, None]
        return self.encoder(x, src_key_padding_mask=mask), hl

    def forward(self, xs, xl, ys, yl):
        h, hl = self.encode(xs, xl)
        # CTC branch
        lp = self.ctc_lo(h).log_softmax(-1).transpose(0, 1)
        tgt = ys.masked_fill(ys == IGNORE_ID, 0)
        loss_ctc = F.ctc_loss(lp.float(), tgt, hl, yl, blank=0, reduction="sum", zero_infinity=True) / xs.size(0)
        # attention branch (teacher forcing)
        b = ys.size(0)
        sos = ys.new_full((b, 1), self.sos)
        ys_in = torch.cat([sos, tgt], 1)
        ys_out = torch.cat([ys, ys.new_full((b, 1), IGNORE_ID)], 1)
        ys_out[torch.arange(b), yl] = self.eos
        L = ys_in.size(1)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=ys.device), 1)
        pad = torch.arange(L, device=ys.device)[None, :] > yl[:, None]
        mem_mask = torch.arange(h.size(1), device=h.device)[None, :] >= hl[:, None]
        d = self.decoder(self.pos(self.embed(ys_in)), h, tgt_mask=causal,
                         tgt_key_padding_mask=pad, memory_key_padding_mask=mem_mask)
        logits = self.dec_out(d)
        loss_att = F.cross_entropy(logits.reshape(-1, self.odim), ys_out.reshape(-1),
                                   ignore_index=IGNORE_ID, label_smoothing=self.lsm)
        acc = ((logits.argmax(-1) == ys_out) & (ys_out != IGNORE_ID)).sum() / (ys_out != IGNORE_ID).sum()
        loss = self.ctc_weight * loss_ctc + (1 - self.ctc_weight) * loss_att
        return loss, loss_ctc.detach(), loss_att.detach(), acc.detach()

    @torch.no_grad()
    def ctc_greedy(self, xs, xl):
        h, hl = self.encode(xs, xl)
        best = self.ctc_lo(h).argmax(-1)
        out = []
        for seq, n in zip(best, hl):
            seq = torch.unique_consecutive(seq[:n])
            out.append(seq[seq != 0])
        return out


def cer_eval(model, loader, device, world):
    model.eval()
    hyps, refs = [], []
    for xs, xl, ys, yl in loader:
        for h in model.module.ctc_greedy(xs.to(device), xl.to(device)):
            hyps.append(h)
        for y, n in zip(ys, yl):
            refs.append(y[:n].to(device))
    hyp_pad = nn.utils.rnn.pad_sequence(hyps, batch_first=True, padding_value=IGNORE_ID)
    ref_pad = nn.utils.rnn.pad_sequence(refs, batch_first=True, padding_value=IGNORE_ID)
    all_hyp = [torch.zeros_like(hyp_pad) for _ in range(world)]
    all_ref = [torch.zeros_like(ref_pad) for _ in range(world)]
    dist.all_gather(all_hyp, hyp_pad)
    dist.all_gather(all_ref, ref_pad)
    errs, tot = 0, 0
    for hp, rp in zip(all_hyp, all_ref):
        for h, r in zip(hp.tolist(), rp.tolist()):
            h = [t for t in h if t != IGNORE_ID]
            r = [t for t in r if t != IGNORE_ID]
            errs += editdistance.eval(h, r)
            tot += len(r)
    model.train()
    return errs / max(tot, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="conf/train_transformer.yaml")
    ap.add_argument("--train-dir", default="dump/train_sp/deltafalse")
    ap.add_argument("--dev-dir", default="dump/dev/deltafalse")
    ap.add_argument("--dict", default="data/lang_1char/train_sp_units.txt")
    ap.add_argument("--outdir", default="exp/train_sp_transformer")
    args = ap.parse_args()
    conf = yaml.safe_load(open(args.config))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    # units.txt: "<blank> 0", "<unk> 1", chars..., and <sos/eos> appended last
    token2id = {"<blank>": 0}
    for line in open(args.dict, encoding="utf-8"):
        tok, idx = line.split()
        token2id[tok] = int(idx)
    odim = len(token2id) + 1

    train_set = KaldiDataset(args.train_dir, token2id)
    dev_set = KaldiDataset(args.dev_dir, token2id)
    sampler = DistributedSampler(train_set, shuffle=True, seed=conf.get("seed", 1))
    train_loader = DataLoader(train_set, batch_size=conf["batch_size"], sampler=sampler, collate_fn=collate,
                              num_workers=conf.get("num_workers", 4), pin_memory=True, drop_last=True)
    dev_loader = DataLoader(Subset(dev_set, range(rank, len(dev_set), world)), batch_size=32,
                            collate_fn=collate, num_workers=2)

    model = JointCTCAttention(80, odim, **conf["model"]).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    # Noam schedule: lr = transformer_lr * adim^-0.5 * min(step^-0.5, step * warmup^-1.5)
    opt = torch.optim.Adam(model.parameters(), lr=conf["transformer_lr"], betas=(0.9, 0.98), eps=1e-9)
    warmup, adim = conf["warmup_steps"], conf["model"]["adim"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: adim ** -0.5 * min((s + 1) ** -0.5, (s + 1) * warmup ** -1.5))
    accum = conf.get("accum_grad", 1)

    os.makedirs(args.outdir, exist_ok=True)
    best = float("inf")
    for epoch in range(conf["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for it, (xs, xl, ys, yl) in enumerate(train_loader):
            xs, xl, ys, yl = xs.to(device), xl.to(device), ys.to(device), yl.to(device)
            if (it + 1) % accum != 0:
                with model.no_sync():
                    loss, lctc, latt, acc = model(xs, xl, ys, yl)
                    (loss / accum).backward()
                continue
            loss, lctc, latt, acc = model(xs, xl, ys, yl)
            (loss / accum).backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), conf.get("grad_clip", 5.0))
            if torch.isfinite(gn):
                opt.step()
            opt.zero_grad()
            sched.step()
            if rank == 0 and (it + 1) % 200 == 0:
                logging.info(f"ep {epoch} it {it + 1} loss {loss.item():.3f} ctc {lctc.item():.3f} "
                             f"att {latt.item():.3f} acc {acc.item():.3f} lr {sched.get_last_lr()[0]:.2e}")

        cer = cer_eval(model, dev_loader, device, world)
        if rank == 0:
            logging.info(f"epoch {epoch} dev CER (ctc greedy) {cer * 100:.2f}")
            torch.save(model.module.state_dict(), os.path.join(args.outdir, f"snapshot.ep.{epoch}"))
            if cer < best:
                best = cer
                torch.save(model.module.state_dict(), os.path.join(args.outdir, "model.acc.best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
