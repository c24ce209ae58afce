"""PPO + IMPALA-CNN on the Procgen benchmark (generalisation protocol: 200 training
levels, evaluation on the full level distribution).

    torchrun --standalone --nproc_per_node=4 ppo_procgen.py --env bigfish
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from procgen import ProcgenEnv
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="bigfish")
    ap.add_argument("--num-levels", type=int, default=200)
    ap.add_argument("--distribution-mode", default="easy")
    ap.add_argument("--num-envs", type=int, default=64)
    ap.add_argument("--num-steps", type=int, default=256)
    ap.add_argument("--timesteps", type=int, default=25_000_000)
    ap.add_argument("--ppo-epochs", type=int, default=3)
    ap.add_argument("--num-minibatches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--gamma", type=float, default=0.999)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--clip-range", type=float, default=0.2)
    ap.add_argument("--ent-coef", type=float, default=0.01)
    ap.add_argument("--vf-coef", type=float, default=0.5)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/procgen")
    return ap.parse_args()


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c0 = nn.Conv2d(c, c, 3, padding=1)
        self.c1 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.c1(F.relu(self.c0(F.relu(x))))


class ImpalaCNN(nn.Module):
    def __init__(self, n_actions, depths=(16, 32, 32)):
        super().__init__()
        layers, cin = [], 3
        for d in depths:
            layers += [nn.Conv2d(cin, d, 3, padding=1), nn.MaxPool2d(3, 2, padding=1), ResBlock(d), ResBlock(d)]
            cin = d
        self.features = nn.Sequential(*layers, nn.ReLU(), nn.Flatten(), nn.Linear(cin * 8 * 8, 256), nn.ReLU())
        self.policy = nn.Linear(256, n_actions)
        self.value = nn.Linear(256, 1)
        nn.init.orthogonal_(self.policy.weight, 0.01)
        nn.init.orthogonal_(self.value.weight, 1.0)

    def forward(self, obs):
        h = self.features(obs.permute(0, 3, 1, 2).float() / 255.0)
        return self.policy(h), self.value(h).squeeze(-1)


def make_venv(args, rank, num_levels, start_level):
    return ProcgenEnv(num_envs=args.num_envs, env_name=args.env, num_levels=num_levels,
                      start_level=start_level, distribution_mode=args.distribution_mode,
                      rand_seed=args.seed * 7919 + rank)


def collect(model, venv, obs, ep_ret, steps, device):
    buf = {k: [] for k in ("obs", "act", "logp", "val", "rew", "done")}
    finished = []
    for _ in range(steps):
        with torch.no_grad():
            logits, val = model(obs)
            d = torch.distributions.Categorical(logits=logits)
            a = d.sample()
        nxt, r, done, _ = venv.step(a.cpu().numpy())
        ep_ret += r
        finished.extend(ep_ret[done].tolist())
        ep_ret[done] = 0.0
        buf["obs"].append(obs)
        buf["act"].append(a)
        buf["logp"].append(d.log_prob(a))
        buf["val"].append(val)
        buf["rew"].append(torch.as_tensor(r, dtype=torch.float32, device=device))
        buf["done"].append(torch.as_tensor(done, dtype=torch.float32, device=device))
        obs = torch.as_tensor(nxt["rgb"], device=device)
    return {k: torch.stack(v) for k, v in buf.items()}, obs, finished


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    train_env = make_venv(args, rank, args.num_levels, 0)
    test_env = make_venv(args, rank, 0, 0)
    n_actions = train_env.action_space.n

    torch.manual_seed(args.seed)
    net = ImpalaCNN(n_actions).to(device)
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    torch.manual_seed(args.seed + rank)

    T, N = args.num_steps, args.num_envs
    n_updates = args.timesteps // (T * N * world)
    mb = T * N // args.num_minibatches
    obs = torch.as_tensor(train_env.reset()["rgb"], device=device)
    test_obs = torch.as_tensor(test_env.reset()["rgb"], device=device)
    ep_ret, test_ep_ret = np.zeros(N), np.zeros(N)
    history = []
    t0 = time.time()

    for update in range(n_updates):
        roll, obs, finished = collect(net, train_env, obs, ep_ret, T, device)
        with torch.no_grad():
            _, last_val = net(obs)
            adv = torch.zeros_like(roll["rew"])
            lastgae = torch.zeros(N, device=device)
            for t in reversed(range(T)):
                nv = last_val if t == T - 1 else roll["val"][t + 1]
                nonterm = 1.0 - roll["done"][t]
                delta = roll["rew"][t] + args.gamma * nv * nonterm - roll["val"][t]
                lastgae = delta + args.gamma * args.lam * nonterm * lastgae
                adv[t] = lastgae
            ret = adv + roll["val"]

        f = {k: v.flatten(0, 1) for k, v in roll.items()}
        f_adv, f_ret = adv.flatten(), ret.flatten()
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(T * N, device=device)
            for i in range(args.num_minibatches):
                idx = perm[i * mb:(i + 1) * mb]
                logits, v = model(f["obs"][idx])
                logp_all = F.log_softmax(logits, -1)
                logp = logp_all.gather(1, f["act"][idx, None]).squeeze(1)
                ratio = (logp - f["logp"][idx]).exp()
                a = (f_adv[idx] - f_adv[idx].mean()) / (f_adv[idx].std() + 1e-8)
                pg = -torch.min(ratio * a, ratio.clamp(1 - args.clip_range, 1 + args.clip_range) * a).mean()
                v_clip = f["val"][idx] + (v - f["val"][idx]).clamp(-args.clip_range, args.clip_range)
                vl = 0.5 * torch.max((v - f_ret[idx]) ** 2, (v_clip - f_ret[idx]) ** 2).mean()
                ent = -(logp_all.exp() * logp_all).sum(-1).mean()
                loss = pg + args.vf_coef * vl - args.ent_coef * ent
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()

        train_stats = torch.tensor([sum(finished), len(finished)], dtype=torch.float32, device=device)
        dist.all_reduce(train_stats)

        if (update + 1) % args.eval_every == 0:
            # test levels: roll the current policy on the unrestricted level distribution
            _, test_obs, test_finished = collect(net, test_env, test_obs, test_ep_ret, T, device)
            test_stats = torch.tensor([sum(test_finished), len(test_finished)], dtype=torch.float32, device=device)
            dist.all_reduce(test_stats)
            if rank == 0:
                row = {
                    "update": update + 1,
                    "timesteps": (update + 1) * T * N * world,
                    "train_return": (train_stats[0] / train_stats[1].clamp(min=1)).item(),
                    "test_return": (test_stats[0] / test_stats[1].clamp(min=1)).item(),
                    "fps": (update + 1) * T * N * world / (time.time() - t0),
                }
                history.append(row)
                print(json.dumps(row), flush=True)
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"{args.env}_progress.json"), "w") as fh:
                    json.dump(history, fh)
                torch.save(net.state_dict(), os.path.join(args.out, f"{args.env}_policy.pt"))

    train_env.close()
    test_env.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
