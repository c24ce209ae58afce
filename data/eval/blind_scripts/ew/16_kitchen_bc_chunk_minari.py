"""Behaviour cloning with observation history and action chunks on Franka Kitchen (Minari D4RL/kitchen).

    torchrun --nproc_per_node=4 16_kitchen_bc_chunk_minari.py --dataset_id D4RL/kitchen/mixed-v2 --out runs/kitchen_bc
"""
import argparse
import datetime
import os
import time

import minari
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--dataset_id", default="D4RL/kitchen/mixed-v2")
parser.add_argument("--out", default="runs/kitchen_bc")
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--obs_hist", type=int, default=4)
parser.add_argument("--chunk", type=int, default=10)
parser.add_argument("--exec_steps", type=int, default=5)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--depth", type=int, default=4)
parser.add_argument("--global_batch", type=int, default=1024)
parser.add_argument("--lr", type=float, default=3e-4)
parser.add_argument("--epochs", type=int, default=200)
parser.add_argument("--eval_every", type=int, default=20)
parser.add_argument("--eval_episodes", type=int, default=25)
parser.add_argument("--seed", type=int, default=0)


class KitchenWindows(Dataset):
    """(obs[t-h+1..t], act[t..t+chunk-1]) windows from variable-length episodes, edge-padded."""

    def __init__(self, episodes, obs_hist, chunk, stats):
        self.obs = [((o - stats["obs_mean"]) / stats["obs_std"]).astype(np.float32) for o, _ in episodes]
        self.act = [((a - stats["act_mean"]) / stats["act_std"]).astype(np.float32) for _, a in episodes]
        self.h, self.chunk = obs_hist, chunk
        self.index = [(e, t) for e, a in enumerate(self.act) for t in range(len(a))]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        e, t = self.index[i]
        T = len(self.act[e])
        o_idx = np.clip(np.arange(t - self.h + 1, t + 1), 0, T - 1)
        a_idx = np.arange(t, t + self.chunk)
        mask = a_idx < T
        return (torch.from_numpy(self.obs[e][o_idx]), torch.from_numpy(self.act[e][np.minimum(a_idx, T - 1)]),
                torch.from_numpy(mask))


class ResMLPBlock(nn.Module):
    def __init__(self, width, p=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(p),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.net(x)


class ChunkPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim, obs_hist, chunk, width, depth):
        super().__init__()
        self.inp = nn.Linear(obs_dim * obs_hist, width)
        self.blocks = nn.Sequential(*[ResMLPBlock(width) for _ in range(depth)])
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, act_dim * chunk))
        self.act_dim, self.chunk = act_dim, chunk

    def forward(self, obs_hist):
        return self.out(self.blocks(self.inp(obs_hist.flatten(1)))).view(-1, self.chunk, self.act_dim)


def load_episodes(dataset):
    eps = []
    for ep in dataset.iterate_episodes():
        obs = ep.observations["observation"][:-1]  # drop the terminal observation
        eps.append((obs.astype(np.float32), ep.actions.astype(np.float32)))
    return eps


@torch.no_grad()
def evaluate(model, env, stats, args, device):
    model.eval()
    o_mean, o_std = stats["obs_mean"], stats["obs_std"]
    a_mean, a_std = stats["act_mean"], stats["act_std"]
    completed = []
    for ep in range(args.eval_episodes):
        obs, _ = env.reset(seed=args.seed * 1000 + ep)
        hist = [(obs["observation"] - o_mean) / o_std] * args.obs_hist
        total, done = 0.0, False
        while not done:
            x = torch.as_tensor(np.stack(hist[-args.obs_hist:]), dtype=torch.float32, device=device)[None]
            acts = model(x)[0, : args.exec_steps].cpu().numpy() * a_std + a_mean
            for a in acts:
                obs, r, term, trunc, _ = env.step(np.clip(a, -1, 1))
                total += r
                hist.append((obs["observation"] - o_mean) / o_std)
                done = term or trunc
                if done:
                    break
        completed.append(total)
    model.train()
    return float(np.mean(completed))


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://", timeout=datetime.timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed + rank)

    if rank == 0:
        minari.load_dataset(args.dataset_id, download=True)  # fetch once into ~/.minari
    dist.barrier()
    dataset = minari.load_dataset(args.dataset_id)
    episodes = load_episodes(dataset)
    all_obs = np.concatenate([o for o, _ in episodes])
    all_act = np.concatenate([a for _, a in episodes])
    stats = {"obs_mean": all_obs.mean(0), "obs_std": all_obs.std(0) + 1e-6,
             "act_mean": all_act.mean(0), "act_std": all_act.std(0) + 1e-6}

    train_set = KitchenWindows(episodes, args.obs_hist, args.chunk, stats)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.global_batch // world_size, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)

    model = ChunkPolicy(all_obs.shape[1], all_act.shape[1], args.obs_hist, args.chunk, args.width, args.depth)
    model = DDP(model.to(device), device_ids=[args.local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.05)

    env = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "stats.npz"), **stats)
        env = dataset.recover_environment()
        print(f"{len(episodes)} episodes, {len(train_set)} windows, {len(loader)} steps/epoch per rank")

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0, agg = time.time(), torch.zeros(2, device=device)
        for obs, act, mask in loader:
            obs, act, mask = obs.to(device), act.to(device), mask.to(device).float()
            pred = model(obs)
            loss = (F.smooth_l1_loss(pred, act, reduction="none").mean(-1) * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch}: loss {(agg[0] / agg[1]).item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"({time.time() - t0:.1f}s)")
            if epoch % args.eval_every == 0:
                score = evaluate(model.module, env, stats, args, device)
                print(f"epoch {epoch}: mean completed subtasks {score:.2f} / 4")
                torch.save({"model": model.module.state_dict(), "stats": stats, "epoch": epoch, "score": score},
                           os.path.join(args.out, f"epoch_{epoch:04d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
