#!/usr/bin/env python
"""Bilinear product/tag scorer on frozen sentence embeddings.

Products and tag names are embedded once by the catalog sentence encoder
(768-d, precomputed). We learn a doc tower, a tag tower initialised from the tag
name embeddings plus a free residual per tag, and train with a BCE loss over
the positives and the top-200 tags of the zero-shot shortlist.

    torchrun --nproc_per_node=8 20_category_tagger_mlp.py --data /mnt/shared/tagging/emb_v3 \
        --out /mnt/shared/tagging/runs/bilinear [--resume]
"""
import argparse
import json
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--max-pos", type=int, default=16)
    ap.add_argument("--shortlist", type=int, default=200)
    ap.add_argument("--global-batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class EmbRows(Dataset):
    def __init__(self, X, Y, SL, max_pos, rows=None):
        self.X, self.Y, self.SL, self.max_pos = X, Y, SL, max_pos
        self.rows = np.arange(X.shape[0]) if rows is None else rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        labs = self.Y.indices[self.Y.indptr[r]:self.Y.indptr[r + 1]][: self.max_pos]
        pos = np.full(self.max_pos, -1, dtype=np.int64)
        pos[: len(labs)] = labs
        return (torch.from_numpy(np.asarray(self.X[r], dtype=np.float32)), torch.from_numpy(pos),
                torch.from_numpy(np.asarray(self.SL[r], dtype=np.int64)))


class Bilinear(nn.Module):
    def __init__(self, tag_name_emb, dim):
        super().__init__()
        in_dim = tag_name_emb.shape[1]
        self.doc = nn.Sequential(nn.Linear(in_dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.tag_proj = nn.Linear(in_dim, dim)
        self.register_buffer("tag_name", torch.from_numpy(tag_name_emb).float(), persistent=False)
        self.tag_free = nn.Embedding(tag_name_emb.shape[0], dim)
        nn.init.zeros_(self.tag_free.weight)

    def tags(self, ids):
        return self.tag_proj(self.tag_name[ids]) + self.tag_free(ids)

    def forward(self, x, cand):
        return torch.einsum("bd,bkd->bk", self.doc(x), self.tags(cand))


def save_checkpoint(path, net, opt, sched, epoch, metrics):
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "metrics": metrics}, path)


@torch.no_grad()
def evaluate(net, loader, device, k=5):
    net.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for x, pos, sl in loader:
        x, pos, sl = x.to(device), pos.to(device), sl.to(device)
        top = sl.gather(1, net(x, sl).topk(k, dim=1).indices)
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        acc[0] += hit[:, 0].sum()
        acc[1] += hit[:, :3].sum() / 3
        acc[2] += hit.sum() / k
        acc[3] += x.size(0)
    dist.all_reduce(acc)
    net.train()
    return {"P@1": (acc[0] / acc[3]).item(), "P@3": (acc[1] / acc[3]).item(),
            "P@5": (acc[2] / acc[3]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    X_tr = np.load(os.path.join(args.data, "X_train.npy"), mmap_mode="r")
    X_te = np.load(os.path.join(args.data, "X_test.npy"), mmap_mode="r")
    SL_tr = np.load(os.path.join(args.data, "zs_shortlist_train.npy"), mmap_mode="r")[:, : args.shortlist]
    SL_te = np.load(os.path.join(args.data, "zs_shortlist_test.npy"), mmap_mode="r")[:, : args.shortlist]
    Y_tr = sp.load_npz(os.path.join(args.data, "Y_train.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.data, "Y_test.npz")).tocsr()
    tag_name_emb = np.load(os.path.join(args.data, "tag_names.npy"))

    train_ds = EmbRows(X_tr, Y_tr, SL_tr, args.max_pos)
    test_ds = EmbRows(X_te, Y_te, SL_te, args.max_pos, rows=np.arange(rank, X_te.shape[0], world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=2048, num_workers=2)

    net = Bilinear(tag_name_emb, args.dim).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    ckpt_path = os.path.join(args.out, "last.pt")
    start = 0
    if args.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1
    # tag_name is a constant buffer (identical on every rank), no need to re-broadcast it each step
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)
    os.makedirs(args.out, exist_ok=True)

    history = []
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (x, pos, sl) in enumerate(train_loader):
            x, pos, sl = x.to(device, non_blocking=True), pos.to(device), sl.to(device)
            in_pos = (sl.unsqueeze(-1) == pos.unsqueeze(1)).any(-1)
            cand = torch.cat([pos.clamp(min=0), sl], dim=1)
            target = torch.cat([(pos >= 0).float(), in_pos.float()], dim=1)
            weight = torch.cat([(pos >= 0).float(), (~in_pos).float()], dim=1)
            logits = model(x, cand)
            loss = (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * weight).sum()
            loss = loss / weight.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)",
                      flush=True)
        sched.step()

        res = evaluate(net, test_loader, device)
        save_checkpoint(ckpt_path, net, opt, sched, epoch, res)
        if rank == 0:
            history.append({"epoch": epoch, **res})
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in res.items()), flush=True)
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
