#!/usr/bin/env python
"""
Single-sequence distogram predictor: axial-attention pair trunk with recycling
(Evoformer-lite, no MSA track).  Crops of 256 residues, activation checkpointing on
every trunk block to fit the L x L x 128 pair tensor.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        19_pair_trunk_recycling_distogram.py --data /datasets/pdb_chains_2023 --out ckpt/trunk
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AA = "ARNDCQEGHILKMFPSTWYVX"
N_BINS = 64          # 2..22 A + "far"


class ChainCrops(Dataset):
    def __init__(self, root, split, crop=256):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.npz")))
        self.crop = crop

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        seq = np.array([AA.find(c) if c in AA else 20 for c in str(z["seq"])], dtype=np.int64)
        cb, mask = z["cb"].astype(np.float32), z["mask"].astype(bool)
        L = len(seq)
        start = random.randint(0, max(0, L - self.crop))
        sl = slice(start, start + self.crop)
        seq, cb, mask = seq[sl], cb[sl], mask[sl]
        pad = self.crop - len(seq)
        d = np.linalg.norm(cb[:, None] - cb[None], axis=-1)
        bins = np.clip(((d - 2.0) / (20.0 / (N_BINS - 1))).astype(np.int64), 0, N_BINS - 1)
        pair_mask = mask[:, None] & mask[None]
        return {
            "seq": torch.from_numpy(np.pad(seq, (0, pad), constant_values=20)),
            "res_mask": torch.from_numpy(np.pad(np.ones(len(seq), bool), (0, pad))),
            "bins": torch.from_numpy(np.pad(bins, ((0, pad), (0, pad)))),
            "pair_mask": torch.from_numpy(np.pad(pair_mask, ((0, pad), (0, pad)))),
        }


class AxialAttention(nn.Module):
    def __init__(self, c, heads, axis):
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.attn = nn.MultiheadAttention(c, heads, batch_first=True)
        self.gate = nn.Linear(c, c)
        self.axis = axis

    def forward(self, z, res_mask):
        if self.axis == 1:
            z = z.transpose(1, 2)
        B, L, _, C = z.shape
        x = self.norm(z).reshape(B * L, L, C)
        kpm = (~res_mask).repeat_interleave(L, dim=0)
        out, _ = self.attn(x, x, x, key_padding_mask=kpm, need_weights=False)
        out = torch.sigmoid(self.gate(x)) * out
        z = z + out.reshape(B, L, L, C)
        return z.transpose(1, 2) if self.axis == 1 else z


class TrunkBlock(nn.Module):
    def __init__(self, c=128, heads=4):
        super().__init__()
        self.row = AxialAttention(c, heads, axis=0)
        self.col = AxialAttention(c, heads, axis=1)
        self.transition = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.ReLU(), nn.Linear(4 * c, c))

    def forward(self, z, res_mask):
        z = self.row(z, res_mask)
        z = self.col(z, res_mask)
        return z + self.transition(z)


class DistogramNet(nn.Module):
    def __init__(self, c=128, blocks=8, n_recycle=3, ckpt=True):
        super().__init__()
        self.seq_emb = nn.Embedding(len(AA), c)
        self.left, self.right = nn.Linear(c, c), nn.Linear(c, c)
        self.relpos = nn.Embedding(65, c)
        self.recycle_norm = nn.LayerNorm(c)
        self.recycle_dist = nn.Linear(N_BINS, c)
        self.blocks = nn.ModuleList([TrunkBlock(c) for _ in range(blocks)])
        self.head = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, N_BINS))
        self.n_recycle, self.ckpt = n_recycle, ckpt

    def forward(self, seq, res_mask):
        s = self.seq_emb(seq)
        L = seq.shape[1]
        rel = (torch.arange(L, device=seq.device)[None] - torch.arange(L, device=seq.device)[:, None]).clamp(-32, 32) + 32
        z0 = self.left(s)[:, :, None] + self.right(s)[:, None] + self.relpos(rel)[None]
        z_prev = torch.zeros_like(z0)
        logits_prev = torch.zeros(*z0.shape[:3], N_BINS, device=z0.device, dtype=z0.dtype)
        for _ in range(self.n_recycle):
            z = z0 + self.recycle_norm(z_prev) + self.recycle_dist(logits_prev.softmax(-1))
            for blk in self.blocks:
                if self.ckpt and self.training:
                    z = checkpoint(blk, z, res_mask, use_reentrant=True)
                else:
                    z = blk(z, res_mask)
            z_prev = z
            logits_prev = self.head(0.5 * (z + z.transpose(1, 2)))
        return logits_prev


def distogram_loss(logits, bins, pair_mask):
    ce = F.cross_entropy(logits.permute(0, 3, 1, 2).float(), bins, reduction="none")
    return (ce * pair_mask).sum() / pair_mask.sum().clamp(min=1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)   # loss*n, correct contacts, n pairs
    for b in loader:
        b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(b["seq"], b["res_mask"])
        pm = b["pair_mask"].float()
        n = pm.sum()
        acc[0] += distogram_loss(logits, b["bins"], pm).double() * n
        acc[1] += ((logits.argmax(-1) == b["bins"]).float() * pm).sum().double()
        acc[2] += n.double()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/trunk")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--recycle", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1234 + rank)

    train_ds, val_ds = ChainCrops(args.data, "train"), ChainCrops(args.data, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4)

    torch.manual_seed(1234)
    model = DistogramNet(n_recycle=args.recycle).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-6)
    warmup = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_par = sum(p.numel() for p in model.parameters())
        print(f"{n_par / 1e6:.1f}M params, world {world}, global batch {args.batch_size * world}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, run = time.time(), torch.zeros(2, device=device)
        for b in loader:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(b["seq"], b["res_mask"])
            loss = distogram_loss(logits, b["bins"], b["pair_mask"].float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        val_loss, val_acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} train {(run[0] / run[1]).item():.4f} val {val_loss:.4f} "
                  f"bin-acc {val_acc:.3f} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"trunk_e{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
