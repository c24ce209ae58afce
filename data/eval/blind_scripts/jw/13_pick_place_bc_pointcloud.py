"""Behaviour cloning of pick-and-place from segmented point clouds.

Demonstrations were collected in simulation with a scripted oracle: for every
step we store the observed point cloud (xyz + rgb + segmentation id) and the
oracle pick / place poses.  The policy predicts both poses; evaluation rolls the
policy out in simulation on held-out task seeds, spread over all GPUs.

    python 13_pick_place_bc_pointcloud.py --demos /data/pp_demos --world-size 4
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from manip_sim import PickPlaceEnv  # our PyBullet task suite


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--demos", required=True)
    p.add_argument("--task", default="stack-blocks")
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=str, default="29533")
    p.add_argument("--points", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=60000)
    p.add_argument("--eval-every", type=int, default=5000)
    p.add_argument("--eval-episodes", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ckpt", default="checkpoints/pp_bc")
    p.add_argument("--resume", default="")
    return p.parse_args()


class DemoSteps(Dataset):
    def __init__(self, root, task, points):
        with open(os.path.join(root, f"{task}.pkl"), "rb") as f:
            episodes = pickle.load(f)
        self.steps = [s for ep in episodes for s in ep]
        self.points = points

    def __len__(self):
        return len(self.steps)

    def __getitem__(self, i):
        s = self.steps[i]
        pc = s["pc"]  # (N, 7): xyz rgb seg
        pc = pc[np.random.choice(len(pc), self.points, replace=len(pc) < self.points)].astype(np.float32)
        act = np.concatenate([s["pick_pos"], s["pick_yaw"][None], s["place_pos"], s["place_yaw"][None]])
        return torch.from_numpy(pc), torch.from_numpy(act.astype(np.float32))


class PointPolicy(nn.Module):
    def __init__(self, in_dim=7):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv1d(in_dim, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
                                 nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                 nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                  nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, pc):
        f = self.enc(pc.transpose(1, 2)).max(-1)[0]
        out = self.head(f)
        pick = torch.cat([out[:, :3], torch.atan2(out[:, 3:4], out[:, 4:5])], 1)
        place = torch.cat([out[:, 5:8], torch.atan2(out[:, 8:9], out[:, 9:10])], 1)
        return pick, place


def bc_loss(pick, place, act):
    yaw_err = lambda a, b: 1 - torch.cos(a - b)
    l_pick = F.mse_loss(pick[:, :3], act[:, :3]) + yaw_err(pick[:, 3], act[:, 3]).mean()
    l_place = F.mse_loss(place[:, :3], act[:, 4:7]) + yaw_err(place[:, 3], act[:, 7]).mean()
    return l_pick + l_place


def gather_variable(t, world):
    """all_gather for 1-D tensors whose length differs per rank."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def rollout(policy, task, seeds, points, device):
    policy.eval()
    env = PickPlaceEnv(task=task, headless=True)
    rewards = []
    for seed in seeds:
        obs = env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            pc = obs["pc"]
            pc = pc[np.random.choice(len(pc), points, replace=len(pc) < points)].astype(np.float32)
            pick, place = policy(torch.from_numpy(pc)[None].to(device))
            obs, r, done, _ = env.step(pick[0].cpu().numpy(), place[0].cpu().numpy())
            total += r
        rewards.append(total)
    env.close()
    policy.train()
    return torch.tensor(rewards, dtype=torch.float32, device=device)


def worker(rank, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    ds = DemoSteps(args.demos, args.task, args.points)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    policy = PointPolicy()
    policy = nn.SyncBatchNorm.convert_sync_batchnorm(policy).to(device)
    policy = DDP(policy, device_ids=[rank])
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr * args.world_size)

    it = 0
    if args.resume:
        state = torch.load(args.resume, map_location={"cuda:0": f"cuda:{rank}"})
        policy.module.load_state_dict(state["policy"])
        opt.load_state_dict(state["opt"])
        it = state["iter"]
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)

    eval_seeds = list(range(10000, 10000 + args.eval_episodes))[rank::args.world_size]
    epoch = it // len(loader)
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for pc, act in loader:
            pc, act = pc.to(device, non_blocking=True), act.to(device, non_blocking=True)
            pick, place = policy(pc)
            loss = bc_loss(pick, place, act)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            it += 1

            if it % 500 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"iter {it} loss {l.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

            if it % args.eval_every == 0:
                rewards = gather_variable(rollout(policy.module, args.task, eval_seeds, args.points, device),
                                          args.world_size)
                if rank == 0:
                    print(f"iter {it} eval: success {(rewards >= 1.0).float().mean():.3f} "
                          f"mean reward {rewards.mean():.3f} median {rewards.median():.3f} "
                          f"({len(rewards)} episodes)", flush=True)
                    torch.save({"policy": policy.module.state_dict(), "opt": opt.state_dict(), "iter": it},
                               os.path.join(args.ckpt, f"policy_{it:06d}.pt"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(worker, args=(args,), nprocs=args.world_size, join=True)
