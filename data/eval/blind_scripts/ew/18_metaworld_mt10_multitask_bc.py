"""Multi-task BC on Meta-World MT10 scripted-policy demonstrations, with evaluation spread over GPUs.

Demos: data/mt10/<env_name>/episode_*.npz with `obs` (T, 39) and `action` (T, 4); episodes end at
success, so lengths vary a lot between tasks.

    torchrun --nproc_per_node=4 18_metaworld_mt10_multitask_bc.py --data_root data/mt10 --out runs/mt10_bc
"""
import argparse
import glob
import os
import time

import metaworld
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--out", default="runs/mt10_bc")
    ap.add_argument("--history", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--global_batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--eval_every", type=int, default=25)
    ap.add_argument("--eval_eps_per_task", type=int, default=20)
    ap.add_argument("--max_path_length", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class MultiTaskDemos(Dataset):
    def __init__(self, root, task_names, history):
        self.history = history
        self.obs, self.act, self.task, self.index = [], [], [], []
        for t_id, name in enumerate(task_names):
            for fn in sorted(glob.glob(os.path.join(root, name, "episode_*.npz"))):
                d = np.load(fn)
                e = len(self.obs)
                self.obs.append(d["obs"].astype(np.float32))
                self.act.append(d["action"].astype(np.float32))
                self.task.append(t_id)
                self.index += [(e, t) for t in range(len(d["action"]))]
        cat = np.concatenate(self.obs)
        self.mean, self.std = cat.mean(0), cat.std(0) + 1e-4
        self.obs = [(o - self.mean) / self.std for o in self.obs]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        e, t = self.index[i]
        idx = np.clip(np.arange(t - self.history + 1, t + 1), 0, None)
        return torch.from_numpy(self.obs[e][idx]), torch.tensor(self.task[e]), torch.from_numpy(self.act[e][t])


class MultiTaskMLP(nn.Module):
    def __init__(self, obs_dim, act_dim, n_tasks, history, hidden):
        super().__init__()
        self.task_emb = nn.Embedding(n_tasks, 64)
        self.net = nn.Sequential(
            nn.Linear(obs_dim * history + 64, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, act_dim), nn.Tanh(),
        )

    def forward(self, obs_hist, task_id):
        return self.net(torch.cat([obs_hist.flatten(1), self.task_emb(task_id)], -1))


@torch.no_grad()
def evaluate(policy, benchmark, task_names, mean, std, args, device, rank, world_size):
    """Each rank evaluates a subset of the tasks; success counts are summed over ranks."""
    policy.eval()
    successes = torch.zeros(len(task_names))
    for t_id in range(rank, len(task_names), world_size):
        name = task_names[t_id]
        env = benchmark.train_classes[name]()
        tasks = [t for t in benchmark.train_tasks if t.env_name == name]
        for ep in range(args.eval_eps_per_task):
            env.set_task(tasks[ep % len(tasks)])
            obs, _ = env.reset()
            hist = [(obs - mean) / std] * args.history
            for _ in range(args.max_path_length):
                x = torch.as_tensor(np.stack(hist[-args.history:]), dtype=torch.float32, device=device)[None]
                a = policy(x, torch.tensor([t_id], device=device))[0].cpu().numpy()
                obs, _, _, truncated, info = env.step(a)
                hist.append((obs - mean) / std)
                if info["success"] or truncated:
                    break
            successes[t_id] += float(info["success"])
        env.close()
    dist.all_reduce(successes)
    policy.train()
    return (successes / args.eval_eps_per_task).tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    benchmark = metaworld.MT10(seed=args.seed)
    task_names = sorted(benchmark.train_classes.keys())
    data = MultiTaskDemos(args.data_root, task_names, args.history)
    sampler = DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.global_batch // world_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = MultiTaskMLP(39, 4, len(task_names), args.history, args.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "obs_norm.npz"), mean=data.mean, std=data.std)
        print(f"{len(data.obs)} demos / {len(data)} transitions over {len(task_names)} tasks")

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for obs, task, act in loader:
            obs, task, act = obs.to(device), task.to(device), act.to(device)
            loss = F.mse_loss(model(obs, task), act)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch}: mse {(tot[0] / tot[1]).item():.5f} ({time.time() - t0:.1f}s)")

        if epoch % args.eval_every == 0:
            per_task = evaluate(net, benchmark, task_names, data.mean, data.std, args, device, rank, world_size)
            if rank == 0:
                for name, sr in zip(task_names, per_task):
                    print(f"  {name:28s} {sr:.2f}")
                print(f"epoch {epoch}: mean success {np.mean(per_task):.3f}")
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                            "task_names": task_names, "success": per_task},
                           os.path.join(args.out, f"epoch_{epoch:04d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
