"""APPO-style learner with an inverse-dynamics auxiliary task, multi-GPU.

* Acting uses a behaviour copy of the policy refreshed every --policy-lag updates;
  value targets are V-trace corrected, the policy loss is PPO-clipped against
  the behaviour log-probs.
* The inverse-dynamics head is trained only every --aux-every updates, hence
  find_unused_parameters=True in DDP.
* Gradient accumulation over --accum micro-batches (no_sync on all but the last).

    torchrun --nproc_per_node=8 appo_aux_tasks.py --task Pong-v5 --resume runs/appo/last.pt
"""
import argparse
import contextlib
import copy
import os
import time

import envpool
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="Pong-v5")
    ap.add_argument("--envs", type=int, default=32, help="per rank")
    ap.add_argument("--unroll", type=int, default=64)
    ap.add_argument("--updates", type=int, default=30000)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--policy-lag", type=int, default=2)
    ap.add_argument("--aux-every", type=int, default=4)
    ap.add_argument("--aux-coef", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--clip", type=float, default=0.1)
    ap.add_argument("--ent", type=float, default=0.01)
    ap.add_argument("--vf", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default="runs/appo")
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU())

    def forward(self, x):
        return self.net(x.float() / 255.0)


class APPOAgent(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.enc = Encoder()
        self.pi = nn.Linear(512, n_actions)
        self.v = nn.Linear(512, 1)
        self.inv_dyn = nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, n_actions))

    def forward(self, obs, next_obs=None):
        h = self.enc(obs)
        out = {"logits": self.pi(h), "value": self.v(h).squeeze(-1)}
        if next_obs is not None:
            h_next = self.enc(next_obs)
            out["inv_logits"] = self.inv_dyn(torch.cat([h, h_next], -1))
        return out


@torch.no_grad()
def vtrace_returns(log_rho, rew, disc, val, boot):
    rho = log_rho.exp().clamp(max=1.0)
    nxt = torch.cat([val[1:], boot[None]])
    delta = rho * (rew + disc * nxt - val)
    acc, vs = torch.zeros_like(boot), torch.zeros_like(val)
    for t in reversed(range(val.shape[0])):
        acc = delta[t] + disc[t] * rho[t] * acc
        vs[t] = acc
    vs = vs + val
    adv = rho * (rew + disc * torch.cat([vs[1:], boot[None]]) - val)
    return vs, adv


def global_normalize(x):
    s = torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), device=x.device)])
    dist.all_reduce(s)
    mean = s[0] / s[2]
    std = (s[1] / s[2] - mean ** 2).clamp(min=1e-8).sqrt()
    return (x - mean) / std


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    envs = envpool.make(args.task, env_type="gymnasium", num_envs=args.envs, seed=args.seed + 7919 * rank,
                        episodic_life=False, reward_clip=True, stack_num=4)
    n_actions = envs.action_space.n

    torch.manual_seed(args.seed)
    agent = APPOAgent(n_actions).to(dev)
    opt = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    start = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        state = {k.removeprefix("module."): v for k, v in ckpt["agent"].items()}
        agent.load_state_dict(state)
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["update"]
    behaviour = copy.deepcopy(agent).eval()
    model = DDP(agent, device_ids=[local_rank], find_unused_parameters=True)
    torch.manual_seed(args.seed + 1 + rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    T, N = args.unroll, args.envs
    obs, _ = envs.reset()
    ep_ret = np.zeros(N)
    tic = time.time()
    for update in range(start, args.updates):
        if update % args.policy_lag == 0:
            behaviour.load_state_dict(agent.state_dict())

        obs_b = torch.zeros((T + 1, N, 4, 84, 84), dtype=torch.uint8, device=dev)
        act_b = torch.zeros((T, N), dtype=torch.long, device=dev)
        blogp_b = torch.zeros((T, N), device=dev)
        rew_b = torch.zeros((T, N), device=dev)
        done_b = torch.zeros((T, N), device=dev)
        finished = []
        for t in range(T):
            o = torch.from_numpy(obs).to(dev)
            with torch.no_grad():
                d = torch.distributions.Categorical(logits=behaviour(o)["logits"])
                a = d.sample()
            obs_b[t], act_b[t], blogp_b[t] = o, a, d.log_prob(a)
            obs, r, term, trunc, _ = envs.step(a.cpu().numpy())
            done = term | trunc
            ep_ret += r
            finished.extend(ep_ret[done].tolist())
            ep_ret[done] = 0.0
            rew_b[t] = torch.from_numpy(r).float().to(dev)
            done_b[t] = torch.from_numpy(done).float().to(dev)
        obs_b[T] = torch.from_numpy(obs).to(dev)

        use_aux = update % args.aux_every == 0
        flat_idx = torch.arange(T * N, device=dev)
        for _ in range(args.epochs):
            with torch.no_grad():
                out = agent(obs_b.flatten(0, 1))
                values = out["value"].view(T + 1, N)
                logp = F.log_softmax(out["logits"].view(T + 1, N, -1)[:-1], -1).gather(-1, act_b[..., None]).squeeze(-1)
                vs, adv = vtrace_returns(logp - blogp_b, rew_b, (1 - done_b) * args.gamma, values[:-1], values[-1])
                adv = global_normalize(adv)

            perm = flat_idx[torch.randperm(T * N, device=dev)]
            chunks = perm.chunk(args.accum)
            f_obs, f_next = obs_b[:-1].flatten(0, 1), obs_b[1:].flatten(0, 1)
            f_act, f_blogp = act_b.flatten(), blogp_b.flatten()
            f_vs, f_adv, f_done = vs.flatten(), adv.flatten(), done_b.flatten()
            opt.zero_grad(set_to_none=True)
            for k, idx in enumerate(chunks):
                sync_ctx = model.no_sync() if k < len(chunks) - 1 else contextlib.nullcontext()
                with sync_ctx:
                    out = model(f_obs[idx], f_next[idx] if use_aux else None)
                    logp_all = F.log_softmax(out["logits"], -1)
                    new_logp = logp_all.gather(-1, f_act[idx, None]).squeeze(-1)
                    ratio = (new_logp - f_blogp[idx]).exp()
                    pg = -torch.min(ratio * f_adv[idx], ratio.clamp(1 - args.clip, 1 + args.clip) * f_adv[idx]).mean()
                    v_loss = 0.5 * (out["value"] - f_vs[idx]).pow(2).mean()
                    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
                    loss = pg + args.vf * v_loss - args.ent * entropy
                    if use_aux:
                        valid = f_done[idx] == 0  # no inverse dynamics across resets
                        inv = F.cross_entropy(out["inv_logits"][valid], f_act[idx][valid]) if valid.any() \
                            else out["inv_logits"].sum() * 0.0
                        loss = loss + args.aux_coef * inv
                    (loss / len(chunks)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()

        gathered = [None] * world
        dist.all_gather_object(gathered, finished)
        if rank == 0:
            all_eps = [x for part in gathered for x in part]
            fps = (update - start + 1) * T * N * world / (time.time() - tic)
            msg = f"upd {update} fps {fps:.0f} pg {pg.item():.3f} v {v_loss.item():.3f} H {entropy.item():.3f}"
            if all_eps:
                msg += f" ret {np.mean(all_eps):.2f} (n={len(all_eps)}, min {np.min(all_eps):.1f}, max {np.max(all_eps):.1f})"
            print(msg, flush=True)
            if (update + 1) % 250 == 0:
                torch.save({"agent": model.state_dict(), "opt": opt.state_dict(), "update": update + 1},
                           os.path.join(args.out, "last.pt"))
        dist.barrier()

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
