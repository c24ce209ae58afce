"""Hybrid CTC/attention AVSR with joint CTC prefix-score beam search (ESPnet-style), LRS3.

    torchrun --nproc_per_node=8 10_avsr_beam_search_eval.py --conf conf/avsr_base.json
"""
import argparse
import json
import math
import os
import time

import jiwer
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(train="data/lrs3/train.jsonl", valid="data/lrs3/valid.jsonl", spm="data/lrs3/spm1000.model",
                exp="exp/avsr_base", epochs=70, batch_size=16, lr=1e-3, warmup=8000, d_model=512,
                enc_layers=12, dec_layers=6, ctc_weight=0.1, decode_ctc_weight=0.3, beam=10, valid_every=5)


class JsonlAV(Dataset):
    def __init__(self, path, sp, train):
        with open(path) as f:
            self.items = [json.loads(l) for l in f]
        self.sp, self.train = sp, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        v = np.load(it["video"]).astype(np.float32) / 255.0
        if self.train:
            dy, dx = np.random.randint(0, 9, 2)
        else:
            dy = dx = 4
        v = (v[:, dy:dy + 88, dx:dx + 88] - 0.421) / 0.165
        a = np.load(it["fbank"]).astype(np.float32)
        T = 4 * v.shape[0]
        a = np.concatenate([a, np.zeros((max(0, T - len(a)), a.shape[1]), np.float32)])[:T]
        return torch.from_numpy(v), torch.from_numpy(a), torch.tensor(self.sp.encode(it["text"])) + 1, it["text"]


def collate(b):
    v, a, y, t = zip(*b)
    ps = nn.utils.rnn.pad_sequence
    return ps(v, True), ps(a, True), torch.tensor([len(x) for x in v]), ps(y, True), torch.tensor([len(x) for x in y]), t


class CTCPrefixScorer:
    """Log-domain CTC prefix scores for one utterance (no batching over beams)."""

    def __init__(self, logp, blank, eos):
        self.x = logp  # T, V
        self.T, self.blank, self.eos = logp.size(0), blank, eos
        self.neg_inf = torch.tensor(-1e10, device=logp.device)

    def initial_state(self):
        r_n = torch.full((self.T,), -1e10, device=self.x.device)
        r_b = torch.cumsum(self.x[:, self.blank], 0)
        return r_n, r_b, 0.0

    def score(self, prefix, state, cands):
        """Return (ctc prefix score per candidate, new states)."""
        r_n_prev, r_b_prev, psi_prev = state
        last = prefix[-1] if len(prefix) > 1 else None
        x_c = self.x[:, cands]                                   # T, C
        r_n = torch.full((self.T, len(cands)), -1e10, device=self.x.device)
        r_b = torch.full_like(r_n, -1e10)
        if len(prefix) == 1:
            r_n[0] = x_c[0]
        r_sum = torch.logaddexp(r_n_prev, r_b_prev)
        phi = r_sum[:, None].expand(-1, len(cands)).clone()
        if last is not None:
            same = torch.tensor([c == last for c in cands], device=self.x.device)
            phi[:, same] = r_b_prev[:, None]
        psi = r_n[0].clone()
        for t in range(1, self.T):
            r_n[t] = torch.logaddexp(r_n[t - 1], phi[t - 1]) + x_c[t]
            r_b[t] = torch.logaddexp(r_b[t - 1], r_n[t - 1]) + self.x[t, self.blank]
            psi = torch.logaddexp(psi, phi[t - 1] + x_c[t])
        is_eos = torch.tensor([c == self.eos for c in cands], device=self.x.device)
        psi = torch.where(is_eos, r_sum[-1].expand_as(psi), psi)
        return psi, [(r_n[:, j], r_b[:, j], psi[j].item()) for j in range(len(cands))]


class AVSR(nn.Module):
    def __init__(self, vocab, d, enc_layers, dec_layers):
        super().__init__()
        self.v_front = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64), nn.ReLU(True),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
            nn.Conv3d(64, 256, (1, 3, 3), (1, 2, 2), (0, 1, 1), bias=False), nn.BatchNorm3d(256), nn.ReLU(True),
            nn.Conv3d(256, 512, (1, 3, 3), (1, 2, 2), (0, 1, 1), bias=False), nn.BatchNorm3d(512), nn.ReLU(True))
        self.a_front = nn.Sequential(nn.Conv1d(80, 512, 3, 2, 1), nn.ReLU(True), nn.Conv1d(512, 512, 3, 2, 1), nn.ReLU(True))
        self.fuse = nn.Linear(1024, d)
        self.pos = nn.Embedding(2048, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True,
                                                                        norm_first=True), enc_layers)
        self.embed = nn.Embedding(vocab, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True,
                                                                        norm_first=True), dec_layers)
        self.ctc_lo = nn.Linear(d, vocab)
        self.out = nn.Linear(d, vocab)
        self.vocab, self.sos, self.eos, self.blank = vocab, vocab - 1, vocab - 1, 0

    def encode(self, v, a, lens):
        t = v.size(1)
        hv = self.v_front(v.unsqueeze(1)).mean((3, 4)).transpose(1, 2)
        ha = self.a_front(a.transpose(1, 2)).transpose(1, 2)[:, :t]
        x = self.fuse(torch.cat([hv, ha], -1)) + self.pos.weight[:t]
        mask = torch.arange(t, device=v.device)[None] >= lens[:, None]
        return self.encoder(x, src_key_padding_mask=mask), mask

    def att_logp(self, ys, mem, mask):
        L = ys.size(1)
        h = self.decoder(self.embed(ys) + self.pos.weight[:L], mem, memory_key_padding_mask=mask,
                         tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=ys.device))
        return self.out(h).float().log_softmax(-1)

    def forward(self, v, a, lens, ys, ylens, ctc_weight):
        mem, mask = self.encode(v, a, lens)
        l_ctc = F.ctc_loss(self.ctc_lo(mem).float().log_softmax(-1).transpose(0, 1), ys, lens, ylens,
                           blank=self.blank, zero_infinity=True)
        ys_in = F.pad(ys, (1, 0), value=self.sos)
        ys_out = F.pad(ys, (0, 1), value=0)
        ys_out[torch.arange(ys.size(0)), ylens] = self.eos
        ys_out[torch.arange(ys_out.size(1), device=ys.device)[None] > ylens[:, None]] = -1
        l_att = F.nll_loss(self.att_logp(ys_in, mem, mask).flatten(0, 1), ys_out.flatten(), ignore_index=-1)
        return ctc_weight * l_ctc + (1 - ctc_weight) * l_att

    @torch.no_grad()
    def beam_search(self, v, a, beam=10, ctc_weight=0.3, pre_beam=15, maxlen_ratio=0.8):
        lens = torch.tensor([v.size(1)], device=v.device)
        mem, mask = self.encode(v, a, lens)
        scorer = CTCPrefixScorer(self.ctc_lo(mem)[0].float().log_softmax(-1), self.blank, self.eos)
        hyps = [{"ys": [self.sos], "score": 0.0, "ctc_state": scorer.initial_state()}]
        ended = []
        for _ in range(max(1, int(maxlen_ratio * v.size(1)))):
            ys = torch.tensor([h["ys"] for h in hyps], device=v.device)
            att = self.att_logp(ys, mem.expand(len(hyps), -1, -1), mask.expand(len(hyps), -1))[:, -1]
            new = []
            for h, att_row in zip(hyps, att):
                att_row[self.blank] = -1e10
                cands = att_row.topk(pre_beam).indices.tolist()
                ctc_psi, states = scorer.score(h["ys"], h["ctc_state"], cands)
                ctc_delta = ctc_psi - h["ctc_state"][2]
                joint = (1 - ctc_weight) * att_row[cands] + ctc_weight * ctc_delta
                for j in joint.topk(min(beam, len(cands))).indices.tolist():
                    new.append({"ys": h["ys"] + [cands[j]], "score": h["score"] + joint[j].item(),
                                "ctc_state": states[j]})
            new.sort(key=lambda h: -h["score"])
            hyps = []
            for h in new[:beam]:
                (ended if h["ys"][-1] == self.eos else hyps).append(h)
            if not hyps or (len(ended) >= beam and max(e["score"] for e in ended) > hyps[0]["score"]):
                break
        best = max(ended or hyps, key=lambda h: h["score"] / len(h["ys"]))
        return [t for t in best["ys"][1:] if t != self.eos]


def run_validation(model, dataset, sp, cfg, rank, world, device):
    model.eval()
    hyps, refs = [], []
    for i in range(rank, len(dataset), world):
        v, a, _, text = dataset[i]
        toks = model.beam_search(v[None].to(device), a[None].to(device), beam=cfg["beam"],
                                 ctc_weight=cfg["decode_ctc_weight"])
        hyps.append(sp.decode([t - 1 for t in toks]))
        refs.append(text)
    gathered = [None] * world
    dist.all_gather_object(gathered, list(zip(refs, hyps)))
    model.train()
    pairs = [p for g in gathered for p in g]
    return jiwer.wer([r for r, _ in pairs], [h for _, h in pairs])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conf", default=None)
    cfg = dict(DEFAULTS)
    conf = ap.parse_args().conf
    if conf:
        with open(conf) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    sp = spm.SentencePieceProcessor(model_file=cfg["spm"])
    vocab = sp.get_piece_size() + 2
    train_ds = JsonlAV(cfg["train"], sp, True)
    valid_ds = JsonlAV(cfg["valid"], sp, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, num_workers=8, collate_fn=collate,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = AVSR(vocab, cfg["d_model"], cfg["enc_layers"], cfg["dec_layers"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / cfg["warmup"], math.sqrt(cfg["warmup"] / (s + 1))))

    if rank == 0:
        os.makedirs(cfg["exp"], exist_ok=True)
        json.dump(cfg, open(os.path.join(cfg["exp"], "config.json"), "w"), indent=2)

    best = 1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (v, a, lens, ys, ylens, _) in enumerate(loader):
            v, a, lens, ys, ylens = (x.to(device, non_blocking=True) for x in (v, a, lens, ys, ylens))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(v, a, lens, ys, ylens, cfg["ctc_weight"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"[{epoch}:{step}] loss={loss.item():.3f} lr={sched.get_last_lr()[0]:.2e} "
                      f"{(step + 1) / (time.time() - t0):.2f} it/s", flush=True)

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(cfg["exp"], "last.pt"))
        if (epoch + 1) % cfg["valid_every"] == 0:
            wer = run_validation(model, valid_ds, sp, cfg, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch}: valid WER {100 * wer:.2f}%", flush=True)
                if wer < best:
                    best = wer
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "wer": wer},
                               os.path.join(cfg["exp"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
