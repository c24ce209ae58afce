"""
Decision Transformer on D4RL MuJoCo datasets, multi-GPU.

Offline RL as sequence modelling: (return-to-go, state, action) tokens, a
causal transformer predicts the action at each state token.

    torchrun --nproc_per_node=4 10_dt_offline_d4rl.py --env hopper --dataset medium-replay
"""
import argparse
import math
import os
import random
import time

import d4rl  # noqa: F401  (registers the offline datasets with gym)
import gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TARGET_RETURN = {"hopper": 3600.0, "halfcheetah": 6000.0, "walker2d": 5000.0}
RTG_SCALE = 1000.0


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="hopper")
    ap.add_argument("--dataset", default="medium-replay")
    ap.add_argument("--context", type=int, default=20)
    ap.add_argument("--embed-dim", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=3)
    ap.add_argument("--n-head", type=int, default=1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--warmup-steps", type=int, default=10_000)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--eval-episodes", type=int, default=8, help="per GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="dt_checkpoints")
    return ap.parse_args()


def discount_cumsum(x, gamma=1.0):
    out = np.zeros_like(x)
    out[-1] = x[-1]
    for t in reversed(range(x.shape[0] - 1)):
        out[t] = x[t] + gamma * out[t + 1]
    return out


def load_trajectories(name):
    env = gym.make(name)
    data = env.get_dataset()
    ends = np.logical_or(data["terminals"], data["timeouts"])
    trajs, start = [], 0
    for i in np.nonzero(ends)[0]:
        sl = slice(start, i + 1)
        trajs.append({"obs": data["observations"][sl].astype(np.float32),
                      "act": data["actions"][sl].astype(np.float32),
                      "rew": data["rewards"][sl].astype(np.float32)})
        start = i + 1
    return env, trajs


class TrajectoryWindows(Dataset):
    """One item = one (trajectory, start) window of length `context`."""

    def __init__(self, trajs, context, state_mean, state_std):
        self.trajs, self.K = trajs, context
        self.mean, self.std = state_mean, state_std
        self.index = [(ti, s) for ti, tr in enumerate(trajs) for s in range(len(tr["obs"]))]
        self.rtg = [discount_cumsum(tr["rew"]) for tr in trajs]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        ti, s = self.index[i]
        tr = self.trajs[ti]
        e = min(s + self.K, len(tr["obs"]))
        n = e - s
        pad = self.K - n
        obs = (tr["obs"][s:e] - self.mean) / self.std
        act = tr["act"][s:e]
        rtg = self.rtg[ti][s:e, None] / RTG_SCALE
        ts = np.arange(s, e)
        return (torch.from_numpy(np.pad(obs, ((pad, 0), (0, 0)))).float(),
                torch.from_numpy(np.pad(act, ((pad, 0), (0, 0)), constant_values=-10.0)).float(),
                torch.from_numpy(np.pad(rtg, ((pad, 0), (0, 0)))).float(),
                torch.from_numpy(np.pad(ts, (pad, 0))).long(),
                torch.from_numpy(np.concatenate([np.zeros(pad), np.ones(n)])).long())


class DecisionTransformer(nn.Module):
    def __init__(self, state_dim, act_dim, d, n_layer, n_head, dropout, max_ep_len=1000, context=20):
        super().__init__()
        self.embed_t = nn.Embedding(max_ep_len, d)
        self.embed_rtg = nn.Linear(1, d)
        self.embed_s = nn.Linear(state_dim, d)
        self.embed_a = nn.Linear(act_dim, d)
        self.ln = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, n_head, 4 * d, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer)
        self.predict_a = nn.Sequential(nn.Linear(d, act_dim), nn.Tanh())
        # large finite negatives instead of -inf: left-padded rows would otherwise be all -inf -> NaN
        self.register_buffer("causal", torch.triu(torch.full((3 * context, 3 * context), -1e9), 1))

    def forward(self, s, a, rtg, t, mask):
        B, K, _ = s.shape
        te = self.embed_t(t)
        tokens = torch.stack([self.embed_rtg(rtg) + te, self.embed_s(s) + te, self.embed_a(a) + te], dim=2)
        tokens = self.ln(tokens.reshape(B, 3 * K, -1))
        pad = (1.0 - mask.float()).repeat_interleave(3, dim=1) * -1e9
        h = self.blocks(tokens, mask=self.causal[:3 * K, :3 * K], src_key_padding_mask=pad)
        h = h.reshape(B, K, 3, -1)
        return self.predict_a(h[:, :, 1])


@torch.no_grad()
def rollout(model, env, target, mean, std, K, device, seed):
    env.seed(seed)
    o = env.reset()
    sd, ad = env.observation_space.shape[0], env.action_space.shape[0]
    states = torch.zeros((0, sd), device=device)
    actions = torch.zeros((0, ad), device=device)
    rtg = torch.tensor([[target / RTG_SCALE]], device=device)
    ts = torch.zeros((1,), dtype=torch.long, device=device)
    total = 0.0
    for t in range(1000):
        states = torch.cat([states, torch.as_tensor((o - mean) / std, dtype=torch.float32, device=device)[None]])
        actions = torch.cat([actions, torch.zeros((1, ad), device=device)])
        s, a, r, tt = states[-K:], actions[-K:], rtg[-K:], ts[-K:]
        n = s.shape[0]
        pad = K - n
        m = torch.cat([torch.zeros(pad, device=device), torch.ones(n, device=device)])[None]
        s = F.pad(s, (0, 0, pad, 0))[None]
        a = F.pad(a, (0, 0, pad, 0))[None]
        r = F.pad(r, (0, 0, pad, 0))[None]
        tt = F.pad(tt, (pad, 0))[None]
        act = model(s, a, r, tt, m)[0, -1]
        actions[-1] = act
        o, rew, done, _ = env.step(act.cpu().numpy())
        total += rew
        rtg = torch.cat([rtg, rtg[-1:] - rew / RTG_SCALE])
        ts = torch.cat([ts, torch.tensor([t + 1], device=device)])
        if done:
            break
    return total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    env, trajs = load_trajectories(f"{args.env}-{args.dataset}-v2")
    all_obs = np.concatenate([tr["obs"] for tr in trajs])
    mean, std = all_obs.mean(0), all_obs.std(0) + 1e-6
    ds = TrajectoryWindows(trajs, args.context, mean, std)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    if rank == 0:
        print(f"{len(trajs)} trajectories, {len(ds)} windows, {len(loader)} batches/epoch/GPU")

    sd, ad = env.observation_space.shape[0], env.action_space.shape[0]
    model = DecisionTransformer(sd, ad, args.embed_dim, args.n_layer, args.n_head, args.dropout,
                                context=args.context).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min((step + 1) / args.warmup_steps, 1.0))

    best = -math.inf
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for s, a, rtg, ts, m in loader:
            s, a, rtg, ts, m = (x.to(device, non_blocking=True) for x in (s, a, rtg, ts, m))
            pred = model(s, a, rtg, ts, m)
            valid = m.bool()
            loss = F.mse_loss(pred[valid], a[valid])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        model.eval()
        eval_env = gym.make(f"{args.env}-{args.dataset}-v2")
        rets = [rollout(model.module, eval_env, TARGET_RETURN[args.env], mean, std, args.context, device,
                        seed=10_000 * (epoch + 1) + 100 * rank + k) for k in range(args.eval_episodes)]
        ev = torch.tensor([sum(rets), len(rets)], dtype=torch.float64, device=device)
        dist.all_reduce(ev)
        mean_ret = (ev[0] / ev[1]).item()
        score = eval_env.get_normalized_score(mean_ret) * 100

        if rank == 0:
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.5f} return {mean_ret:.1f} "
                  f"normalized {score:.1f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.out, exist_ok=True)
            ckpt = {"model": model.module.state_dict(), "state_mean": mean, "state_std": std,
                    "epoch": epoch, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out, f"dt_{args.env}_{args.dataset}_last.pt"))
            if score > best:
                best = score
                torch.save(ckpt, os.path.join(args.out, f"dt_{args.env}_{args.dataset}_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
