"""
A2C on Atari with envpool, DDP across GPUs, preemption-safe (periodic
checkpoints + --resume).

    torchrun --nproc_per_node=8 15_a2c_resume.py --env Breakout-v5 --ckpt-dir /shared/a2c_breakout --resume
"""
import argparse
import glob
import os
import signal
import time

import envpool
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="Breakout-v5")
    p.add_argument("--num-envs", type=int, default=32)
    p.add_argument("--rollout", type=int, default=5)
    p.add_argument("--total-updates", type=int, default=200_000)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--entropy", type=float, default=0.01)
    p.add_argument("--value", type=float, default=0.5)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default="a2c_ckpt")
    p.add_argument("--ckpt-every", type=int, default=2_000)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class AtariA2C(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 32, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 7 * 7, 512), nn.ReLU())
        self.pi = nn.Linear(512, n_actions)
        self.v = nn.Linear(512, 1)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.orthogonal_(m.weight, np.sqrt(2))
                nn.init.zeros_(m.bias)
        nn.init.orthogonal_(self.pi.weight, 0.01)
        nn.init.orthogonal_(self.v.weight, 1.0)

    def forward(self, x):
        h = self.body(x.float() / 255.0)
        return self.pi(h), self.v(h).squeeze(-1)


def latest_checkpoint(ckpt_dir):
    files = sorted(glob.glob(os.path.join(ckpt_dir, "a2c_*.pt")))
    return files[-1] if files else None


def save_checkpoint(ckpt_dir, update, policy, optimizer, frames, keep):
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"a2c_{update:08d}.pt")
    tmp = path + ".tmp"
    torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                "update": update, "frames": frames}, tmp)
    os.replace(tmp, path)
    for old in sorted(glob.glob(os.path.join(ckpt_dir, "a2c_*.pt")))[:-keep]:
        os.remove(old)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    envs = envpool.make(args.env, env_type="gymnasium", num_envs=args.num_envs,
                        seed=args.seed + 10_000 * rank, episodic_life=True, reward_clip=True)
    n_actions = envs.action_space.n

    net = AtariA2C(n_actions).to(device)
    optimizer = torch.optim.RMSprop(net.parameters(), lr=args.lr, alpha=0.99, eps=1e-5)

    start_update, frames = 1, 0
    if args.resume:
        path = latest_checkpoint(args.ckpt_dir)
        if path is not None:
            ckpt = torch.load(path, map_location=device)
            net.load_state_dict(ckpt["policy"])
            optimizer.load_state_dict(ckpt["optimizer"])
            start_update, frames = ckpt["update"] + 1, ckpt["frames"]
            if rank == 0:
                print(f"resumed from {path} (update {ckpt['update']}, {frames} frames)")

    policy = DDP(net, device_ids=[local_rank])

    stop_requested = False

    def on_sigterm(signum, frame):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_sigterm)

    obs, _ = envs.reset()
    obs = torch.as_tensor(obs, device=device)
    ep_ret = np.zeros(args.num_envs)
    done_returns = []
    t0 = time.time()

    for update in range(start_update, args.total_updates + 1):
        lr = args.lr * (1 - (update - 1) / args.total_updates)
        for g in optimizer.param_groups:
            g["lr"] = lr

        obs_l, act_l, rew_l, mask_l = [], [], [], []
        for _ in range(args.rollout):
            with torch.no_grad():
                logits, _ = policy.module(obs)
            act = torch.distributions.Categorical(logits=logits).sample()
            nobs, rew, term, trunc, info = envs.step(act.cpu().numpy())
            ep_ret += info["reward"]
            for e in np.nonzero((term | trunc) & (info["lives"] == 0))[0]:
                done_returns.append(ep_ret[e])
                ep_ret[e] = 0
            obs_l.append(obs)
            act_l.append(act)
            rew_l.append(torch.as_tensor(rew, dtype=torch.float32, device=device))
            mask_l.append(torch.as_tensor(1.0 - (term | trunc), dtype=torch.float32, device=device))
            obs = torch.as_tensor(nobs, device=device)
        frames += args.rollout * args.num_envs * world

        with torch.no_grad():
            _, R = policy.module(obs)
            rets = []
            for r, m in zip(reversed(rew_l), reversed(mask_l)):
                R = r + args.gamma * R * m
                rets.append(R)
            rets = torch.stack(rets[::-1]).reshape(-1)

        logits, values = policy(torch.cat(obs_l))
        pd = torch.distributions.Categorical(logits=logits)
        logp = pd.log_prob(torch.cat(act_l))
        adv = rets - values
        loss = -(logp * adv.detach()).mean() + args.value * adv.pow(2).mean() - args.entropy * pd.entropy().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(policy.parameters(), args.clip)
        optimizer.step()

        # agree on preemption so every rank leaves the loop at the same update
        flag = torch.tensor([1.0 if stop_requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stopping = flag.item() > 0

        if update % 200 == 0:
            s = torch.tensor([float(sum(done_returns)), float(len(done_returns))], device=device)
            dist.all_reduce(s)
            done_returns.clear()
            if rank == 0 and s[1] > 0:
                print(f"update {update} frames {frames} return {(s[0] / s[1]).item():.2f} "
                      f"loss {loss.item():.3f} fps {frames / (time.time() - t0):.0f}", flush=True)

        if update % args.ckpt_every == 0 or stopping or update == args.total_updates:
            if rank == 0:
                save_checkpoint(args.ckpt_dir, update, policy, optimizer, frames, args.keep)
            dist.barrier()
        if stopping:
            if rank == 0:
                print(f"SIGTERM received, stopped after update {update}")
            break

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
