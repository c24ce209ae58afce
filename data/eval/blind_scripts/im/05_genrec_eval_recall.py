"""Generative recommender over semantic IDs with an nn.Transformer encoder-decoder.

The decoder emits exactly `num_levels` code tokens; level l can only emit codes of
codebook l, so decoding is a fixed-length beam search with per-level vocab masks.

    torchrun --nproc_per_node=8 05_genrec_eval_recall.py --data data/ml1m --epochs 100
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, BOS = 0, 1
OFFSET = 2


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--codebook_size", type=int, default=256)
    ap.add_argument("--max_hist", type=int, default=50)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--nhead", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--ckpt", default="ckpt/genrec_ml1m.pt")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


class SeqData(Dataset):
    def __init__(self, seqs, codes, K, max_hist, split):
        self.codes, self.K, self.L = codes, K, codes.shape[1]
        self.max_hist = max_hist
        self.rows = []
        for s in seqs:
            if split == "train":
                for t in range(1, len(s) - 2):
                    self.rows.append((s[:t], s[t]))
            elif split == "val":
                self.rows.append((s[:-2], s[-2]))
            else:
                self.rows.append((s[:-1], s[-1]))

    def tok(self, item):
        return [OFFSET + l * self.K + int(c) for l, c in enumerate(self.codes[item])]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        hist, tgt = self.rows[i]
        hist = hist[-self.max_hist:]
        src = [t for it in hist for t in self.tok(it)]
        return torch.tensor(src), torch.tensor(self.tok(tgt))


def pad_collate(batch):
    src, tgt = zip(*batch)
    src = nn.utils.rnn.pad_sequence(src, batch_first=True, padding_value=PAD)
    return src, torch.stack(tgt)


class GenRec(nn.Module):
    def __init__(self, vocab, L, K, d_model, nhead, layers, dropout, max_len=1024):
        super().__init__()
        self.L, self.K = L, K
        self.tok = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d_model)
        self.level = nn.Embedding(L + 1, d_model)
        self.tf = nn.Transformer(d_model, nhead, layers, layers, 4 * d_model, dropout, batch_first=True,
                                 norm_first=True)
        self.head = nn.Linear(d_model, vocab)

    def embed_src(self, src):
        pos = torch.arange(src.size(1), device=src.device)
        lvl = pos % self.L
        return self.tok(src) + self.pos(pos)[None] + self.level(lvl)[None]

    def embed_tgt(self, tgt_in):
        pos = torch.arange(tgt_in.size(1), device=tgt_in.device)
        return self.tok(tgt_in) + self.level(pos)[None]

    def encode(self, src):
        return self.tf.encoder(self.embed_src(src), src_key_padding_mask=src.eq(PAD))

    def decode(self, memory, src, tgt_in):
        mask = self.tf.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        h = self.tf.decoder(self.embed_tgt(tgt_in), memory, tgt_mask=mask, memory_key_padding_mask=src.eq(PAD))
        return self.head(h)

    def forward(self, src, tgt):
        bos = torch.full((tgt.size(0), 1), BOS, dtype=torch.long, device=tgt.device)
        logits = self.decode(self.encode(src), src, torch.cat([bos, tgt[:, :-1]], 1))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))

    @torch.no_grad()
    def beam_search(self, src, beam):
        B = src.size(0)
        memory = self.encode(src)
        memory = memory.repeat_interleave(beam, 0)
        src_r = src.repeat_interleave(beam, 0)
        seqs = torch.full((B * beam, 1), BOS, dtype=torch.long, device=src.device)
        scores = torch.zeros(B, beam, device=src.device)
        scores[:, 1:] = -1e9
        for l in range(self.L):
            logits = self.decode(memory, src_r, seqs)[:, -1]
            lo, hi = OFFSET + l * self.K, OFFSET + (l + 1) * self.K
            logp = F.log_softmax(logits[:, lo:hi], -1).view(B, beam, self.K)
            cand = (scores.unsqueeze(-1) + logp).view(B, -1)
            scores, flat = cand.topk(beam, -1)
            prev, code = flat // self.K, flat % self.K
            seqs = seqs.view(B, beam, -1).gather(1, prev.unsqueeze(-1).expand(-1, -1, seqs.size(1)))
            seqs = torch.cat([seqs, (lo + code).unsqueeze(-1)], -1).view(B * beam, -1)
        return seqs[:, 1:].view(B, beam, self.L)


def run_eval(model, loader, device, ks=(1, 5, 10)):
    model.eval()
    hits = {k: 0 for k in ks}
    ndcg = {k: 0.0 for k in ks}
    n = 0
    for src, tgt in loader:
        src, tgt = src.to(device), tgt.to(device)
        preds = model.beam_search(src, max(ks))
        eq = (preds == tgt[:, None]).all(-1)
        pos = torch.where(eq.any(-1), eq.float().argmax(-1), torch.full_like(eq[:, 0], -1, dtype=torch.long))
        for k in ks:
            hit = (pos >= 0) & (pos < k)
            hits[k] += int(hit.sum())
            ndcg[k] += float((hit.float() / torch.log2(pos.clamp(min=0).float() + 2)).sum())
        n += src.size(0)
    stats = torch.tensor([hits[k] for k in ks] + [ndcg[k] for k in ks] + [n], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    total = stats[-1].item()
    out = {f"R@{k}": stats[i].item() / total for i, k in enumerate(ks)}
    out.update({f"N@{k}": stats[len(ks) + i].item() / total for i, k in enumerate(ks)})
    model.train()
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    codes = np.load(os.path.join(args.data, "sem_ids.npy"))
    with open(os.path.join(args.data, "user_seqs.json")) as f:
        seqs = [s for s in json.load(f).values() if len(s) >= 5]
    L = codes.shape[1]
    vocab = OFFSET + L * args.codebook_size

    train = SeqData(seqs, codes, args.codebook_size, args.max_hist, "train")
    val = SeqData(seqs, codes, args.codebook_size, args.max_hist, "val")
    tr_sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    tr_loader = DataLoader(train, args.bs, sampler=tr_sampler, collate_fn=pad_collate, num_workers=4,
                           pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val), world))
    va_loader = DataLoader(torch.utils.data.Subset(val, val_idx), 256, collate_fn=pad_collate, num_workers=2)

    net = GenRec(vocab, L, args.codebook_size, args.d_model, args.nhead, args.layers, args.dropout,
                 max_len=args.max_hist * L).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    start_epoch, best = 0, 0.0
    if args.resume and os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    model = DDP(net, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        for src, tgt in tr_loader:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            loss = model(src, tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(tot)

        metrics = run_eval(net, va_loader, device)
        if rank == 0:
            print(f"ep {epoch} loss {(tot[0] / tot[1]).item():.4f} " +
                  " ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
            if metrics["R@10"] > best:
                best = metrics["R@10"]
                os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "best": best},
                           args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
