"""DLRM trainer with separate optimizers for embedding tables (row-wise Adagrad
style, plain Adagrad here) and the dense MLPs (Adam), step-based checkpointing
so preempted jobs can pick up where they stopped.

    torchrun --nproc_per_node=8 09_dlrm_dense_sparse.py --data /mnt/recsys/ctr_v2 \
        --run_dir /mnt/recsys/runs/dlrm_ds --resume /mnt/recsys/runs/dlrm_ds/step_40000.pt
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("dlrm")

N_DENSE = 13
TABLE_SIZES = [39884, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532, 2953, 403, 10,
               2208, 11938, 155, 4, 976, 14, 39979, 25641, 39664, 585, 12972, 108, 36]


class CtrData(Dataset):
    def __init__(self, files):
        tables = [pq.read_table(f) for f in files]
        dense, sparse, y = [], [], []
        for t in tables:
            dense.append(np.stack([t.column(f"d{i}").to_numpy() for i in range(N_DENSE)], 1))
            sparse.append(np.stack([t.column(f"s{i}").to_numpy() for i in range(len(TABLE_SIZES))], 1))
            y.append(t.column("label").to_numpy())
        self.dense = np.log1p(np.maximum(np.concatenate(dense).astype(np.float32), 0))
        self.sparse = np.concatenate(sparse).astype(np.int64)
        self.y = np.concatenate(y).astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.y[i]


def make_mlp(dims, final_relu):
    mods = []
    for i in range(len(dims) - 1):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or final_relu:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


class DLRM(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.emb = nn.ModuleList([nn.Embedding(n, dim) for n in TABLE_SIZES])
        self.bot = make_mlp([N_DENSE, 512, 256, dim], final_relu=True)
        f = len(TABLE_SIZES) + 1
        self.top = make_mlp([dim + f * (f - 1) // 2, 1024, 1024, 512, 256, 1], final_relu=False)
        r, c = torch.tril_indices(f, f, offset=-1)
        self.register_buffer("r", r, persistent=False)
        self.register_buffer("c", c, persistent=False)

    def forward(self, dense, sparse):
        x = self.bot(dense)
        t = torch.stack([x] + [e(sparse[:, i]) for i, e in enumerate(self.emb)], 1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.r, self.c]
        return self.top(torch.cat([x, z], 1)).squeeze(1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    ps, ys = [], []
    for d, s, y in loader:
        ps.append(torch.sigmoid(net(d.to(device), s.to(device))).cpu())
        ys.append(y)
    net.train()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (torch.cat(ps).numpy(), torch.cat(ys).numpy()))
    p = np.concatenate([o[0] for o in out])
    y = np.concatenate([o[1] for o in out])
    return roc_auc_score(y, p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--dense_lr", type=float, default=1e-3)
    ap.add_argument("--sparse_lr", type=float, default=0.02)
    ap.add_argument("--max_steps", type=int, default=120_000)
    ap.add_argument("--ckpt_every", type=int, default=10_000)
    ap.add_argument("--eval_every", type=int, default=10_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format=f"%(asctime)s [{rank}/{world}] %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    train = CtrData(sorted(glob.glob(os.path.join(args.data, "train", "part-*.parquet"))))
    val = CtrData(sorted(glob.glob(os.path.join(args.data, "val", "part-*.parquet"))))
    sampler = DistributedSampler(train, shuffle=True, seed=123, drop_last=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val, list(range(rank, len(val), world))), batch_size=16384, num_workers=4)

    torch.manual_seed(123)
    model = DLRM(args.dim).to(device)
    sparse_opt = torch.optim.Adagrad(model.emb.parameters(), lr=args.sparse_lr)
    dense_opt = torch.optim.Adam(list(model.bot.parameters()) + list(model.top.parameters()), lr=args.dense_lr)

    step, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        sparse_opt.load_state_dict(ckpt["sparse_opt"])
        dense_opt.load_state_dict(ckpt["dense_opt"])
        step, best = ckpt["step"], ckpt.get("best_auc", 0.0)
        log.info("resumed from %s (step %d)", args.resume, step)

    model = DDP(model, device_ids=[local_rank])

    def checkpoint(name):
        if rank == 0:
            state = {"model": model.state_dict(), "sparse_opt": sparse_opt.state_dict(),
                     "dense_opt": dense_opt.state_dict(), "step": step, "best_auc": best}
            torch.save(state, os.path.join(args.run_dir, name))
        dist.barrier()

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    epoch = step // len(train_loader)
    skip = step % len(train_loader)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for i, (d, s, y) in enumerate(train_loader):
            if skip:
                if i < skip:
                    continue
                skip = 0
            d, s, y = d.to(device, non_blocking=True), s.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(d, s), y)
            sparse_opt.zero_grad(set_to_none=True)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            step += 1

            if step % 500 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                log.info("step %d epoch %d loss %.5f %.2f it/s", step, epoch, l.item() / world,
                         500 / (time.time() - t0))
                t0 = time.time()
            if step % args.eval_every == 0:
                auc = evaluate(model.module, val_loader, device)
                log.info("step %d val auc %.5f", step, auc)
                if auc > best:
                    best = auc
                    checkpoint("best.pt")
            if step % args.ckpt_every == 0:
                checkpoint(f"step_{step}.pt")
            if step >= args.max_steps:
                break
        epoch += 1

    checkpoint("final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
