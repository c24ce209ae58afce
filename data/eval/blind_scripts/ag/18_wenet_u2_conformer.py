# Conformer CTC/attention (WeNet-style) on AISHELL-2 with duration-bucketed dynamic batches.
#
#   torchrun --nnodes=1 --nproc_per_node=8 18_wenet_u2_conformer.py --config conf/train_conformer.yaml \
#       --train_data data/train/data.list --cv_data data/dev/data.list --model_dir exp/conformer
import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import torchaudio.compliance.kaldi as kaldi
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

IGNORE_ID = -1


class ListDataset(Dataset):
    def __init__(self, data_list, symbol_table, cmvn):
        self.items = [json.loads(l) for l in open(data_list, encoding="utf8")]
        self.symbols = symbol_table
        self.mean, self.istd = cmvn

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        wav, sr = torchaudio.load(it["wav"])
        f = kaldi.fbank(wav * (1 << 15), num_mel_bins=80, frame_length=25, frame_shift=10, dither=0.1,
                        sample_frequency=sr)
        f = (f - self.mean) * self.istd
        y = torch.tensor([self.symbols.get(c, 1) for c in it["txt"]])
        return f, y


class LocalBucketSampler(Sampler):
    """Each rank buckets its own shard by duration; batch count per rank may differ (see train loop)."""

    def __init__(self, durations, max_frames, rank, world_size, seed=777):
        self.durations = durations
        self.max_frames = max_frames
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def batches(self):
        rng = random.Random(self.seed + self.epoch)
        idx = list(range(len(self.durations)))
        rng.shuffle(idx)  # same permutation on every rank
        mine = sorted(idx[self.rank::self.world_size], key=lambda i: self.durations[i])
        out, cur, longest = [], [], 0
        for i in mine:
            frames = int(self.durations[i] * 100)
            if cur and max(longest, frames) * (len(cur) + 1) > self.max_frames:
                out.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, frames)
        if cur:
            out.append(cur)
        rng.shuffle(out)
        return out

    def __iter__(self):
        return iter(self.batches())

    def __len__(self):
        return len(self.batches())


def collate(batch):
    xs, ys = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([x.size(0) for x in xs]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=IGNORE_ID),
            torch.tensor([y.size(0) for y in ys]))


class U2Conformer(nn.Module):
    def __init__(self, vocab, d=256, heads=4, elayers=12, dlayers=6, ctc_weight=0.3):
        super().__init__()
        self.vocab, self.sos, self.eos, self.ctc_weight = vocab, vocab - 1, vocab - 1, ctc_weight
        self.embed_in = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.embed_out = nn.Linear(d * 19, d)
        self.encoder = torchaudio.models.Conformer(d, heads, 2048, elayers, 15, dropout=0.1)
        self.ctc = nn.Linear(d, vocab)
        self.tok_emb = nn.Embedding(vocab, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, heads, 2048, 0.1, batch_first=True,
                                                                        norm_first=True), dlayers)
        self.dec_out = nn.Linear(d, vocab)

    def encode(self, x, xl):
        x = self.embed_in(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.embed_out(x.transpose(1, 2).reshape(b, t, c * f))
        hl = (((xl - 1) // 2 - 1) // 2).clamp(max=t)
        return self.encoder(x, hl)

    def forward(self, x, xl, y, yl):
        h, hl = self.encode(x, xl)
        lp = self.ctc(h).log_softmax(-1).transpose(0, 1)
        loss_ctc = F.ctc_loss(lp.float(), y.clamp(min=0), hl, yl, reduction="sum", zero_infinity=True) / x.size(0)
        b = y.size(0)
        y_in = torch.cat([y.new_full((b, 1), self.sos), y.clamp(min=0)], 1)
        y_out = torch.cat([y, y.new_full((b, 1), IGNORE_ID)], 1)
        y_out[torch.arange(b), yl] = self.eos
        L = y_in.size(1)
        d = self.decoder(self.tok_emb(y_in), h,
                         tgt_mask=torch.triu(torch.ones(L, L, dtype=torch.bool, device=y.device), 1),
                         tgt_key_padding_mask=torch.arange(L, device=y.device)[None] > yl[:, None],
                         memory_key_padding_mask=torch.arange(h.size(1), device=y.device)[None] >= hl[:, None])
        loss_att = F.cross_entropy(self.dec_out(d).reshape(-1, self.vocab).float(), y_out.reshape(-1),
                                   ignore_index=IGNORE_ID, label_smoothing=0.1)
        return self.ctc_weight * loss_ctc + (1 - self.ctc_weight) * loss_att, loss_ctc, loss_att


def load_cmvn(path):
    s = json.load(open(path))
    mean = torch.tensor(s["mean_stat"]) / s["frame_num"]
    var = torch.tensor(s["var_stat"]) / s["frame_num"] - mean ** 2
    return mean, 1.0 / var.clamp(min=1e-20).sqrt()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--train_data", required=True)
    ap.add_argument("--cv_data", required=True)
    ap.add_argument("--symbol_table", default="data/dict/lang_char.txt")
    ap.add_argument("--cmvn", default="data/train/global_cmvn")  # produced by tools/compute_cmvn_stats.py
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--checkpoint", default=None)
    args = ap.parse_args()
    conf = yaml.safe_load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    symbols = {l.split()[0]: int(l.split()[1]) for l in open(args.symbol_table, encoding="utf8")}
    vocab = len(symbols)
    cmvn = load_cmvn(args.cmvn)
    train_set = ListDataset(args.train_data, symbols, cmvn)
    cv_set = ListDataset(args.cv_data, symbols, cmvn)
    sampler = LocalBucketSampler([it["duration"] for it in train_set.items], conf["max_frames_in_batch"],
                                 rank, world)
    train_loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=collate, num_workers=8,
                              pin_memory=True, prefetch_factor=4)
    cv_loader = DataLoader(torch.utils.data.Subset(cv_set, range(rank, len(cv_set), world)), batch_size=16,
                           collate_fn=collate, num_workers=2)

    model = U2Conformer(vocab, **conf["model"]).to(device)
    start_epoch = 0
    if args.checkpoint:
        ckpt = torch.load(args.checkpoint, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=conf["lr"])
    warm = conf["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, (warm / (s + 1)) ** 0.5))
    if args.checkpoint:
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
    accum = conf.get("accum_grad", 4)
    os.makedirs(args.model_dir, exist_ok=True)

    for epoch in range(start_epoch, conf["max_epoch"]):
        sampler.set_epoch(epoch)
        # Ranks bucket different shards, so agree on the smallest batch count for this epoch;
        # the sampler is deterministic for a given epoch, so len() matches what iteration yields.
        n_local = torch.tensor(len(sampler), device=device)
        dist.all_reduce(n_local, op=dist.ReduceOp.MIN)
        n_steps = n_local.item() // accum * accum
        model.train()
        for step, (x, xl, y, yl) in enumerate(itertools.islice(train_loader, n_steps)):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            sync = (step + 1) % accum == 0
            with contextlib.nullcontext() if sync else model.no_sync():
                loss, l_ctc, l_att = model(x, xl, y, yl)
                (loss / accum).backward()
            if not sync:
                continue
            gn = nn.utils.clip_grad_norm_(model.parameters(), conf.get("grad_clip", 5.0))
            if math.isfinite(gn.item()):
                opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if rank == 0 and (step + 1) % (accum * 25) == 0:
                logging.info(f"epoch {epoch} step {step + 1}/{n_steps} loss {loss.item():.3f} "
                             f"ctc {l_ctc.item():.3f} att {l_att.item():.3f} lr {sched.get_last_lr()[0]:.2e}")

        model.eval()
        tot = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, xl, y, yl in cv_loader:
                loss, _, _ = model.module(x.to(device), xl.to(device), y.to(device), yl.to(device))
                tot[0] += loss.item() * x.size(0)
                tot[1] += x.size(0)
        dist.all_reduce(tot)
        cv_loss = (tot[0] / tot[1]).item()
        logging.info(f"epoch {epoch} cv_loss {cv_loss:.4f}")
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "cv_loss": cv_loss},
                       os.path.join(args.model_dir, f"{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
