"""
Two-stage pipeline in one job:
  stage 1: train the RQ-VAE item tokenizer (DDP), save it
  stage 2: reload it frozen, map every item to its semantic ID (+ collision suffix),
           train the generative recommender (DDP) on the resulting token sequences.

torchrun --standalone --nproc_per_node=8 12_rqvae_then_freeze.py --data data/games
"""
import argparse
import json
import os
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration


class RQVAE(nn.Module):
    def __init__(self, in_dim, latent=32, levels=3, K=256, beta=0.25):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, latent))
        self.dec = nn.Sequential(nn.Linear(latent, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(),
                                 nn.Linear(512, in_dim))
        self.codebooks = nn.ModuleList([nn.Embedding(K, latent) for _ in range(levels)])
        self.beta = beta

    def quantize(self, z):
        r, zq, loss, codes = z, 0, 0, []
        for cb in self.codebooks:
            i = torch.cdist(r, cb.weight).argmin(-1)
            q = cb(i)
            loss = loss + F.mse_loss(q, r.detach()) + self.beta * F.mse_loss(r, q.detach())
            zq, r = zq + q, r - q.detach()
            codes.append(i)
        return z + (zq - z).detach(), loss, torch.stack(codes, -1)

    def forward(self, x):
        zq, vq, codes = self.quantize(self.enc(x))
        return self.dec(zq), vq, codes


def train_tokenizer(args, emb, device, local_rank, rank):
    ds = TensorDataset(emb)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.rq_bs, sampler=sampler, drop_last=True, num_workers=2)
    tok = DDP(RQVAE(emb.size(1), levels=args.levels, K=args.K).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(tok.parameters(), lr=1e-3)
    for ep in range(args.rq_epochs):
        sampler.set_epoch(ep)
        s = torch.zeros(2, device=device)
        for (x,) in dl:
            x = x.to(device)
            xh, vq, _ = tok(x)
            loss = F.mse_loss(xh, x) + vq
            opt.zero_grad()
            loss.backward()
            opt.step()
            s += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(s)
        if rank == 0 and ep % 20 == 0:
            print(f"[rqvae] epoch {ep} loss {(s[0] / s[1]).item():.5f}", flush=True)
    if rank == 0:
        torch.save(tok.state_dict(), args.rq_ckpt)
    dist.barrier()


@torch.no_grad()
def assign_semantic_ids(tok, emb, device):
    codes = []
    for i in range(0, len(emb), 8192):
        codes.append(tok(emb[i:i + 8192].to(device))[2].cpu())
    codes = torch.cat(codes).numpy()
    seen = defaultdict(int)
    suffix = np.zeros(len(codes), dtype=np.int64)
    for j, c in enumerate(map(tuple, codes)):
        suffix[j] = seen[c]
        seen[c] += 1
    return np.concatenate([codes, suffix[:, None]], 1), max(seen.values())


class SeqDS(Dataset):
    def __init__(self, seqs, sem, K, split):
        self.sem, self.K, self.rows = sem, K, []
        for s in seqs:
            if split == "train":
                self.rows += [(s[max(0, t - 20):t], s[t]) for t in range(1, len(s) - 2)]
            else:
                self.rows.append((s[-22:-2], s[-2]))

    def ids(self, it):
        return [2 + l * self.K + int(c) for l, c in enumerate(self.sem[it])]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        h, t = self.rows[i]
        return [x for it in h for x in self.ids(it)], self.ids(t) + [1]


def collate(b):
    L = max(len(s) for s, _ in b)
    src = torch.zeros(len(b), L, dtype=torch.long)
    for i, (s, _) in enumerate(b):
        src[i, :len(s)] = torch.tensor(s)
    return src, torch.tensor([t for _, t in b])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--rq_bs", type=int, default=1024)
    ap.add_argument("--rq_epochs", type=int, default=200)
    ap.add_argument("--rq_ckpt", default="ckpt/games_rqvae.pt")
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--skip_stage1", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    if rank == 0:
        os.makedirs(os.path.dirname(args.rq_ckpt), exist_ok=True)

    emb = torch.from_numpy(np.load(os.path.join(args.data, "item_emb.npy"))).float()
    if not args.skip_stage1:
        train_tokenizer(args, emb, device, local_rank, rank)

    # ---------------- stage 2 ----------------
    tok = RQVAE(emb.size(1), levels=args.levels, K=args.K).to(device)
    tok.load_state_dict(torch.load(args.rq_ckpt, map_location=device))
    tok.eval().requires_grad_(False)
    sem, max_dup = assign_semantic_ids(tok, emb, device)
    n_levels = sem.shape[1]
    if max_dup > args.K:
        raise RuntimeError(f"collision group of {max_dup} does not fit in the suffix level")
    if rank == 0:
        np.save(os.path.join(os.path.dirname(args.rq_ckpt), "games_sem_ids.npy"), sem)
        print(f"semantic ids: {n_levels} levels, largest collision group {max_dup}")

    with open(os.path.join(args.data, "seqs.json")) as f:
        seqs = json.load(f)
    tr, va = SeqDS(seqs, sem, args.K, "train"), SeqDS(seqs, sem, args.K, "valid")
    sampler = DistributedSampler(tr, shuffle=True)
    tr_dl = DataLoader(tr, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)
    va_dl = DataLoader(Subset(va, range(rank, len(va), world)), batch_size=128, collate_fn=collate)

    cfg = T5Config(vocab_size=2 + n_levels * args.K, d_model=128, d_ff=1024, d_kv=64, num_layers=4, num_heads=6,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    rec = T5ForConditionalGeneration(cfg).to(device)
    model = DDP(rec, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.035)

    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        s = torch.zeros(2, device=device)
        for src, lab in tr_dl:
            src, lab = src.to(device), lab.to(device)
            loss = model(input_ids=src, attention_mask=(src != 0).long(), labels=lab).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            s += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(s)

        rec.eval()
        h = torch.zeros(2, device=device)
        with torch.no_grad():
            for src, lab in va_dl:
                src, lab = src.to(device), lab.to(device)
                g = rec.generate(input_ids=src, attention_mask=(src != 0).long(), num_beams=10,
                                 num_return_sequences=10, max_new_tokens=n_levels + 1)
                g = g[:, 1:n_levels + 1].view(src.size(0), 10, n_levels)
                h[0] += (g == lab[:, None, :n_levels]).all(-1).any(-1).sum()
                h[1] += src.size(0)
        rec.train()
        dist.all_reduce(h)
        if rank == 0:
            print(f"[rec] epoch {ep} loss {(s[0] / s[1]).item():.4f} recall@10 {(h[0] / h[1]).item():.4f}")
            torch.save(rec.state_dict(), os.path.join(os.path.dirname(args.rq_ckpt), "games_rec.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
