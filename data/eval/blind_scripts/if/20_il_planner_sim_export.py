"""Imitation-learning planner for nuPlan with TorchScript export for the closed-loop simulator.

After training, the best checkpoint is loaded into a fresh planner and scripted so the C++
simulation workers (nuplan-devkit planner wrapper) can run it without Python model code.

    torchrun --nproc_per_node=8 20_il_planner_sim_export.py --cache /data/nuplan/il_cache \
        --out /data/exp/il_planner_v7 [--resume /data/exp/il_planner_v7/last.pt]
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_AGENTS, N_LANES, LANE_PTS = 40, 96, 20
HIST, PLAN = 10, 16


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class ILCache(Dataset):
    def __init__(self, root, split):
        self.arrays = np.load(os.path.join(root, f"{split}.npz"), mmap_mode="r")
        self.n = self.arrays["ego"].shape[0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        a = self.arrays
        return (torch.from_numpy(np.array(a["ego"][i], dtype=np.float32)),  # [HIST, 6]
                torch.from_numpy(np.array(a["agents"][i], dtype=np.float32)),  # [N_AGENTS, HIST, 6]
                torch.from_numpy(np.array(a["lanes"][i], dtype=np.float32)),  # [N_LANES, LANE_PTS, 4]
                torch.from_numpy(np.array(a["route"][i], dtype=np.float32)),  # [N_LANES]
                torch.from_numpy(np.array(a["plan"][i], dtype=np.float32)))  # [PLAN, 3]


class ILPlanner(nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.ego = nn.GRU(6, d, batch_first=True)
        self.agents = nn.Sequential(nn.Linear(HIST * 6, d), nn.ReLU(), nn.Linear(d, d))
        self.lanes = nn.Sequential(nn.Linear(4, d), nn.ReLU(), nn.Linear(d, d))
        self.route = nn.Linear(1, d)
        self.attn = nn.MultiheadAttention(d, 8, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(), nn.Linear(d, PLAN * 3))

    def forward(self, ego, agents, lanes, route):
        _, h = self.ego(ego)
        e = h[-1]
        a = self.agents(agents.flatten(2))
        l = self.lanes(lanes).max(2).values + self.route(route.unsqueeze(-1))
        kv = torch.cat([a, l], 1)
        pad = kv.abs().sum(-1) == 0
        ctx = self.attn(e.unsqueeze(1), kv, kv, key_padding_mask=pad)[0].squeeze(1)
        return self.head(torch.cat([e, self.norm(ctx)], -1)).view(-1, PLAN, 3)


def plan_loss(pred, gt):
    pos = F.smooth_l1_loss(pred[..., :2], gt[..., :2])
    yaw = (1 - torch.cos(pred[..., 2] - gt[..., 2])).mean()
    return pos + yaw


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds = ILCache(args.cache, "train"), ILCache(args.cache, "val")
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_dl = DataLoader(train_ds, args.batch_size, sampler=tr_sampler, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(val_ds, args.batch_size, sampler=va_sampler, num_workers=args.workers, pin_memory=True)

    model = DDP(ILPlanner().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world * args.batch_size / 1024)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    start_epoch, best_fde = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_fde = ckpt["epoch"] + 1, ckpt["best_fde"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ego, agents, lanes, route, plan in tr_dl:
            ego, agents, lanes = ego.to(device), agents.to(device), lanes.to(device)
            route, plan = route.to(device), plan.to(device)
            loss = plan_loss(model(ego, agents, lanes, route), plan)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        acc = torch.zeros(3, device=device)
        with torch.no_grad():
            for ego, agents, lanes, route, plan in va_dl:
                pred = model(ego.to(device), agents.to(device), lanes.to(device), route.to(device))
                d = (pred[..., :2] - plan.to(device)[..., :2]).norm(dim=-1)
                acc += torch.stack([d.mean(-1).sum(), d[:, -1].sum(), torch.tensor(float(len(d)), device=device)])
        dist.all_reduce(acc)
        ade, fde = (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()
        if rank == 0:
            print(f"epoch {epoch}: val ADE {ade:.3f} FDE {fde:.3f} lr {sched.get_last_lr()[0]:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            is_best = fde < best_fde
            best_fde = min(fde, best_fde)
            ckpt = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch, "best_fde": best_fde}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if is_best:
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        planner = ILPlanner()
        best = torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")
        planner.load_state_dict(best["model"])
        planner.eval()
        example = (torch.zeros(1, HIST, 6), torch.zeros(1, N_AGENTS, HIST, 6),
                   torch.zeros(1, N_LANES, LANE_PTS, 4), torch.zeros(1, N_LANES))
        scripted = torch.jit.trace(planner, example)
        scripted.save(os.path.join(args.out, "planner_traced.pt"))
        print(f"exported planner from epoch {best['epoch']} (val FDE {best['best_fde']:.3f})", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
