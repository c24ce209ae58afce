"""Conservative Q-Learning (CQL-SAC) on Minari offline datasets, DDP over GPUs.

The replay buffer is the whole offline dataset; every rank holds a copy and draws
independent uniform minibatches with its own generator.

    torchrun --nproc_per_node=2 11_cql_minari_replay.py --dataset mujoco/hopper/medium-v0
"""
import argparse
import copy
import os

import minari
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="mujoco/hopper/medium-v0")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--batch_size", type=int, default=256, help="per rank")
    p.add_argument("--actor_lr", type=float, default=1e-4)
    p.add_argument("--critic_lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=5e-3)
    p.add_argument("--cql_alpha", type=float, default=5.0)
    p.add_argument("--n_random", type=int, default=10)
    p.add_argument("--eval_freq", type=int, default=10_000)
    p.add_argument("--eval_episodes", type=int, default=10)
    p.add_argument("--ckpt", default="ckpt/cql/latest.pt")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_transitions(name):
    ds = minari.load_dataset(name)
    obs, act, rew, nobs, term = [], [], [], [], []
    for ep in ds.iterate_episodes():
        obs.append(ep.observations[:-1]); nobs.append(ep.observations[1:])
        act.append(ep.actions); rew.append(ep.rewards); term.append(ep.terminations)
    data = {k: np.concatenate(v).astype(np.float32) for k, v in
            dict(obs=obs, act=act, rew=rew, nobs=nobs, term=term).items()}
    return data, ds


class Buffer:
    def __init__(self, data, device, seed):
        self.mean = data["obs"].mean(0)
        self.std = data["obs"].std(0) + 1e-3
        norm = lambda x: (x - self.mean) / self.std
        self.t = {
            "obs": torch.from_numpy(norm(data["obs"])).to(device),
            "nobs": torch.from_numpy(norm(data["nobs"])).to(device),
            "act": torch.from_numpy(data["act"]).to(device),
            "rew": torch.from_numpy(data["rew"]).to(device).unsqueeze(-1),
            "term": torch.from_numpy(data["term"]).to(device).unsqueeze(-1),
        }
        self.n = self.t["obs"].shape[0]
        self.g = torch.Generator(device=device).manual_seed(seed)

    def sample(self, b):
        idx = torch.randint(self.n, (b,), generator=self.g, device=self.g.device)
        return {k: v[idx] for k, v in self.t.items()}


class Critic(nn.Module):
    def __init__(self, od, ad, h=256):
        super().__init__()
        mk = lambda: nn.Sequential(nn.Linear(od + ad, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                                   nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1))
        self.q1, self.q2 = mk(), mk()

    def forward(self, o, a):
        x = torch.cat([o, a], -1)
        return self.q1(x), self.q2(x)


class TanhGaussianActor(nn.Module):
    def __init__(self, od, ad, h=256):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(od, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.mu, self.log_std = nn.Linear(h, ad), nn.Linear(h, ad)

    def forward(self, o, deterministic=False):
        h = self.trunk(o)
        mu, log_std = self.mu(h), self.log_std(h).clamp(-5, 2)
        d = torch.distributions.Normal(mu, log_std.exp())
        u = mu if deterministic else d.rsample()
        a = torch.tanh(u)
        logp = d.log_prob(u).sum(-1, keepdim=True) - (2 * (np.log(2) - u - F.softplus(-2 * u))).sum(-1, keepdim=True)
        return a, logp


def soft_update(target, src, tau):
    with torch.no_grad():
        for tp, p in zip(target.parameters(), src.parameters()):
            tp.lerp_(p, tau)


def average_grad(t, world):
    dist.all_reduce(t.grad)
    t.grad.div_(world)


@torch.no_grad()
def evaluate(actor, env, buf, episodes, seed, device):
    total = 0.0
    for i in range(episodes):
        o, _ = env.reset(seed=seed + i)
        done, ret = False, 0.0
        while not done:
            x = torch.as_tensor((o - buf.mean) / buf.std, dtype=torch.float32, device=device)[None]
            a, _ = actor(x, deterministic=True)
            o, r, term, trunc, _ = env.step(a[0].cpu().numpy())
            ret += r
            done = term or trunc
        total += ret
    return total


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device("cuda", lr_)

    data, mds = load_transitions(args.dataset)
    buf = Buffer(data, dev, seed=args.seed * 7919 + rank)
    od, ad = data["obs"].shape[1], data["act"].shape[1]
    env = mds.recover_environment()

    critic = Critic(od, ad).to(dev)
    actor = TanhGaussianActor(od, ad).to(dev)
    critic_t = copy.deepcopy(critic).requires_grad_(False)
    log_alpha = torch.zeros((), device=dev, requires_grad=True)
    target_ent = -float(ad)

    critic_opt = torch.optim.Adam(critic.parameters(), lr=args.critic_lr)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=args.actor_lr)
    alpha_opt = torch.optim.Adam([log_alpha], lr=args.actor_lr)

    start = 0
    if os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location=dev)
        critic.load_state_dict(ck["critic"]); critic_t.load_state_dict(ck["critic_t"])
        actor.load_state_dict(ck["actor"])
        with torch.no_grad():
            log_alpha.copy_(ck["log_alpha"])
        critic_opt.load_state_dict(ck["critic_opt"]); actor_opt.load_state_dict(ck["actor_opt"])
        alpha_opt.load_state_dict(ck["alpha_opt"])
        start = ck["step"]

    critic_ddp = DDP(critic, device_ids=[lr_])
    actor_ddp = DDP(actor, device_ids=[lr_])

    writer = None
    if rank == 0:
        os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
        writer = SummaryWriter(os.path.join(os.path.dirname(args.ckpt), "tb"))

    for step in range(start, args.steps):
        b = buf.sample(args.batch_size)
        o, a, r, no, term = b["obs"], b["act"], b["rew"], b["nobs"], b["term"]
        alpha = log_alpha.exp().detach()

        with torch.no_grad():
            na, nlogp = actor(no)
            tq = torch.min(*critic_t(no, na)) - alpha * nlogp
            y = r + args.gamma * (1 - term) * tq
        q1, q2 = critic_ddp(o, a)
        td = F.mse_loss(q1, y) + F.mse_loss(q2, y)

        # CQL(H) regulariser: logsumexp over random + policy actions minus data Q
        B, N = o.shape[0], args.n_random
        rep_o = o.unsqueeze(1).expand(B, N, od).reshape(B * N, od)
        rep_no = no.unsqueeze(1).expand(B, N, od).reshape(B * N, od)
        with torch.no_grad():
            rand_a = torch.empty(B * N, ad, device=dev).uniform_(-1, 1)
            pi_a, pi_logp = actor(rep_o)
            npi_a, npi_logp = actor(rep_no)
        cat_o = torch.cat([rep_o, rep_o, rep_o])
        cat_a = torch.cat([rand_a, pi_a, npi_a])
        cq1, cq2 = critic_ddp.module(cat_o, cat_a)
        corr = torch.cat([torch.full_like(pi_logp, ad * np.log(2.0)), pi_logp, npi_logp])
        cq1 = (cq1 - corr).view(3, B, N).permute(1, 0, 2).reshape(B, 3 * N)
        cq2 = (cq2 - corr).view(3, B, N).permute(1, 0, 2).reshape(B, 3 * N)
        cql = (torch.logsumexp(cq1, 1).mean() - q1.mean()) + (torch.logsumexp(cq2, 1).mean() - q2.mean())
        critic_loss = td + args.cql_alpha * cql
        critic_opt.zero_grad(set_to_none=True)
        critic_loss.backward()
        critic_opt.step()

        pa, plogp = actor_ddp(o)
        qpi = torch.min(*critic(o, pa))
        actor_loss = (alpha * plogp - qpi).mean()
        actor_opt.zero_grad(set_to_none=True)
        actor_loss.backward()
        actor_opt.step()

        alpha_loss = -(log_alpha * (plogp.detach() + target_ent)).mean()
        alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        average_grad(log_alpha, world)
        alpha_opt.step()

        soft_update(critic_t, critic, args.tau)

        if (step + 1) % args.eval_freq == 0:
            n_local = len(range(rank, args.eval_episodes, world))
            ret_sum = evaluate(actor, env, buf, n_local, seed=10_000 + 97 * rank, device=dev)
            stats = torch.tensor([ret_sum, n_local, td.item(), cql.item(), actor_loss.item()],
                                 dtype=torch.float64, device=dev)
            dist.all_reduce(stats)
            if rank == 0:
                avg_ret = (stats[0] / stats[1]).item()
                writer.add_scalar("eval/return", avg_ret, step + 1)
                writer.add_scalar("loss/td", stats[2].item() / world, step + 1)
                writer.add_scalar("loss/cql", stats[3].item() / world, step + 1)
                writer.add_scalar("loss/actor", stats[4].item() / world, step + 1)
                writer.add_scalar("alpha", alpha.item(), step + 1)
                print(f"[{step + 1}] return {avg_ret:.1f}", flush=True)
                torch.save({"critic": critic.state_dict(), "critic_t": critic_t.state_dict(),
                            "actor": actor.state_dict(), "log_alpha": log_alpha.detach(),
                            "critic_opt": critic_opt.state_dict(), "actor_opt": actor_opt.state_dict(),
                            "alpha_opt": alpha_opt.state_dict(), "step": step + 1}, args.ckpt + ".tmp")
                os.replace(args.ckpt + ".tmp", args.ckpt)
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
