"""ComplEx on a large internal KG dump (int64 id triples in .npy).

Jobs on the shared queue get preempted, so training checkpoints every N steps
and resumes from the newest one automatically.

    torchrun --nnodes=1 --nproc_per_node=8 06_complex_large_resume.py \
        --data /datasets/kg_dump_2024_03 --run_dir /shared/runs/complex_big
"""
import argparse
import glob
import json
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class NpyTriples(Dataset):
    def __init__(self, path):
        self.x = np.load(path, mmap_mode="r")

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.x[i], dtype=np.int64))


class ComplEx(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.dim = dim
        self.ent_re = nn.Embedding(n_ent, dim)
        self.ent_im = nn.Embedding(n_ent, dim)
        self.rel_re = nn.Embedding(n_rel, dim)
        self.rel_im = nn.Embedding(n_rel, dim)
        for e in (self.ent_re, self.ent_im, self.rel_re, self.rel_im):
            nn.init.normal_(e.weight, std=1e-3)

    def score(self, h, r, t_re, t_im):
        hr, hi = self.ent_re(h), self.ent_im(h)
        rr, ri = self.rel_re(r), self.rel_im(r)
        a = hr * rr - hi * ri
        b = hr * ri + hi * rr
        if t_re.dim() == 3:
            return torch.einsum("bd,bkd->bk", a, t_re) + torch.einsum("bd,bkd->bk", b, t_im)
        return (a * t_re + b * t_im).sum(-1)

    def forward(self, h, r, t, neg):
        pos = self.score(h, r, self.ent_re(t), self.ent_im(t))
        negs = self.score(h, r, self.ent_re(neg), self.ent_im(neg))
        reg = sum(e.pow(2).mean() for e in (self.ent_re(h), self.ent_im(h), self.ent_re(t),
                                            self.ent_im(t), self.rel_re(r), self.rel_im(r)))
        return pos, negs, reg

    @torch.no_grad()
    def scores_all(self, h, r):
        hr, hi = self.ent_re(h), self.ent_im(h)
        rr, ri = self.rel_re(r), self.rel_im(r)
        a = hr * rr - hi * ri
        b = hr * ri + hi * rr
        return a @ self.ent_re.weight.t() + b @ self.ent_im.weight.t()


def latest_checkpoint(run_dir):
    cks = glob.glob(os.path.join(run_dir, "step_*.pt"))
    if not cks:
        return None
    return max(cks, key=lambda p: int(re.search(r"step_(\d+)", p).group(1)))


def save_checkpoint(run_dir, step, epoch, model, opt):
    path = os.path.join(run_dir, f"step_{step:08d}.pt")
    torch.save({"step": step, "epoch": epoch, "model": model.state_dict(),
                "opt": opt.state_dict()}, path + ".partial")
    os.rename(path + ".partial", path)
    # keep the last two
    for old in sorted(glob.glob(os.path.join(run_dir, "step_*.pt")))[:-2]:
        os.remove(old)


@torch.no_grad()
def filtered_mrr(model, triples, filt, device, rank, world, bs=128):
    mine = torch.from_numpy(np.ascontiguousarray(triples[rank::world]))
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for i in range(0, len(mine), bs):
        b = mine[i:i + bs].to(device)
        sc = model.scores_all(b[:, 0], b[:, 1])
        tgt = sc.gather(1, b[:, 2:3]).clone()
        for j, (h, r, t) in enumerate(b.tolist()):
            other = filt.get((h, r))
            if other is not None:
                sc[j, other] = float("-inf")
        sc.scatter_(1, b[:, 2:3], tgt)
        rank_ = (sc > tgt).sum(1) + 1
        s[0] += (1.0 / rank_.double()).sum()
        s[1] += (rank_ <= 10).sum()
        s[2] += rank_.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--neg", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--reg", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--ckpt_every", type=int, default=5000)
    ap.add_argument("--eval_triples", type=int, default=20000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "meta.json")) as f:
        meta = json.load(f)
    n_ent, n_rel = meta["num_entities"], meta["num_relations"]

    train = NpyTriples(os.path.join(args.data, "train.npy"))
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler,
                        num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    valid = np.load(os.path.join(args.data, "valid.npy"))[:args.eval_triples]
    # filter only against the eval triples' (h, r) keys to keep host memory sane
    keys = {(int(h), int(r)) for h, r, _ in valid}
    filt = {}
    for part in ("train.npy", "valid.npy", "test.npy"):
        arr = np.load(os.path.join(args.data, part), mmap_mode="r")
        for lo in range(0, arr.shape[0], 5_000_000):
            chunk = np.asarray(arr[lo:lo + 5_000_000])
            for h, r, t in chunk.tolist():
                if (h, r) in keys:
                    filt.setdefault((h, r), []).append(t)

    model = ComplEx(n_ent, n_rel, args.dim).to(device)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    step, start_epoch = 0, 0
    ck = latest_checkpoint(args.run_dir)
    if ck is not None:
        state = torch.load(ck)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, start_epoch = state["step"], state["epoch"]
        if rank == 0:
            print(f"resumed from {ck} (step {step}, epoch {start_epoch})", flush=True)
        del state
    ddp = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
    steps_per_epoch = len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = step - epoch * steps_per_epoch  # batches already done in this epoch
        t0 = time.time()
        for i, x in enumerate(loader):
            if i < skip:
                continue
            x = x.to(device, non_blocking=True)
            neg = torch.randint(n_ent, (x.size(0), args.neg), device=device)
            pos, negs, reg = ddp(x[:, 0], x[:, 1], x[:, 2], neg)
            loss = F.softplus(-pos).mean() + F.softplus(negs).mean() + args.reg * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 200 == 0 and rank == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (i + 1 - max(skip, 0)):.3f}s/it", flush=True)
            if step % args.ckpt_every == 0:
                if rank == 0:
                    save_checkpoint(args.run_dir, step, epoch, model, opt)
                dist.barrier()

        mrr, h10 = filtered_mrr(model, valid, filt, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: valid MRR {mrr:.4f} Hits@10 {h10:.4f}", flush=True)
            save_checkpoint(args.run_dir, step, epoch + 1, model, opt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
