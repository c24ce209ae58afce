"""Dilated-ResNet neural solver for 2D Kolmogorov flow (Re=1000, 64x64, periodic)
trained with the pushforward trick (Brandstetter et al. 2022): a random number of
unrolled steps is run without gradient before the supervised step, so the model
learns to correct its own rollout errors.

    torchrun --standalone --nproc_per_node=4 14_kolmogorov_flow_pushforward.py --data /data/jaxcfd/kolmogorov_re1000.h5
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="HDF5 with 'train/velocity' and 'test/velocity' [N, T, 2, 64, 64]")
    p.add_argument("--ckpt-dir", default="checkpoints/kolmogorov_pf")
    p.add_argument("--resume", default="")
    p.add_argument("--max-pushforward", type=int, default=4)
    p.add_argument("--hidden", type=int, default=48)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--base-lr", type=float, default=2e-4, help="lr for a global batch of 32, scaled linearly")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--eval-rollout", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb-project", default="neural-pde-solvers")
    return p.parse_args()


class Windows(Dataset):
    def __init__(self, path, split, length):
        self.path, self.split, self.length = path, split, length
        with h5py.File(path, "r") as f:
            n, T = f[f"{split}/velocity"].shape[:2]
        self.items = [(i, t) for i in range(n) for t in range(T - length + 1)]
        self.f = None

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        i, t = self.items[k]
        return torch.from_numpy(self.f[f"{self.split}/velocity"][i, t:t + self.length].astype(np.float32))


class DilatedBlock(nn.Module):
    def __init__(self, c, dilations=(1, 2, 4, 8, 4, 2, 1)):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(c, c, 3, padding=d, dilation=d, padding_mode="circular") for d in dilations])
        self.norm = nn.GroupNorm(4, c)

    def forward(self, x):
        h = self.norm(x)
        for conv in self.convs:
            h = F.gelu(conv(h))
        return x + h


class DilResNet(nn.Module):
    def __init__(self, hidden, blocks):
        super().__init__()
        self.enc = nn.Conv2d(2, hidden, 3, padding=1, padding_mode="circular")
        self.blocks = nn.Sequential(*[DilatedBlock(hidden) for _ in range(blocks)])
        self.dec = nn.Conv2d(hidden, 2, 3, padding=1, padding_mode="circular")

    def forward(self, u):
        return u + self.dec(self.blocks(self.enc(u)))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    # per-rank generator for the pushforward depth; the supervised step is identical in
    # structure on every rank, only the no-grad prefix length differs
    rng = np.random.default_rng(args.seed + rank)

    train = Windows(args.data, "train", args.max_pushforward + 2)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.micro_batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DilResNet(args.hidden, args.blocks).cuda()
    model = DDP(model, device_ids=[local_rank])
    global_batch = args.micro_batch * args.accum * world
    lr = args.base_lr * global_batch / 32
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)

    start_epoch = 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        wandb.init(project=args.wandb_project, config={**vars(args), "world": world, "lr": lr,
                                                       "global_batch": global_batch})

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device="cuda")
        opt.zero_grad(set_to_none=True)
        for it, window in enumerate(loader):
            if it >= steps_per_epoch * args.accum:
                break
            window = window.cuda(non_blocking=True)
            k = int(rng.integers(0, args.max_pushforward + 1))
            u = window[:, 0]
            if k > 0:
                with torch.no_grad():
                    for j in range(k):
                        u = model.module(u)
            target = window[:, k + 1]
            last_micro = (it + 1) % args.accum == 0
            if last_micro:
                loss = F.mse_loss(model(u), target) / args.accum
                loss.backward()
            else:
                with model.no_sync():
                    loss = F.mse_loss(model(u), target) / args.accum
                    loss.backward()
            tot += torch.stack([loss.detach() * args.accum, torch.ones((), device="cuda")])
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        dist.all_reduce(tot)

        if rank == 0:
            # rollout on a few held-out trajectories, rank 0 only, on the plain module
            model.eval()
            with torch.no_grad(), h5py.File(args.data, "r") as f:
                gt = torch.from_numpy(f["test/velocity"][:8, : args.eval_rollout + 1].astype(np.float32)).cuda()
                u = gt[:, 0]
                corr = []
                for t in range(1, args.eval_rollout + 1):
                    u = model.module(u)
                    a, b = u.flatten(1), gt[:, t].flatten(1)
                    corr.append(F.cosine_similarity(a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)).mean().item())
            t_decor = next((t for t, c in enumerate(corr, 1) if c < 0.95), args.eval_rollout)
            wandb.log({"train/mse": (tot[0] / tot[1]).item(), "eval/time_to_decorrelate": t_decor,
                       "eval/corr_final": corr[-1], "lr": sched.get_last_lr()[0], "epoch": epoch})
            print(f"epoch {epoch} {time.time() - t0:.0f}s mse {(tot[0] / tot[1]).item():.3e} "
                  f"decorrelation @ {t_decor}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, "last.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
