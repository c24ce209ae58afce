"""
Self-play PPO for 2-player Hanabi (shared-parameter policy for both seats).

Each rank steps its own batch of Hanabi games on CPU; the policy runs on the
rank's GPU; PPO updates are synchronised with DDP.

    torchrun --nproc_per_node=8 hanabi_ppo.py --envs-per-rank 256 --run-name ppo-mlp-1024
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from hanabi_learning_environment import rl_env
from torch.nn.parallel import DistributedDataParallel as DDP


class VecHanabi:
    def __init__(self, n, seed, players=2):
        self.envs = [rl_env.make("Hanabi-Full", num_players=players) for _ in range(n)]
        for i, e in enumerate(self.envs):
            e.game.seed = seed + i
        self.obs = [e.reset() for e in self.envs]
        self.n_actions = self.envs[0].num_moves()
        self.obs_dim = self.envs[0].vectorized_observation_shape()[0]
        self.ep_ret = np.zeros(n)
        self.finished = []

    def current(self):
        x = np.zeros((len(self.envs), self.obs_dim), np.float32)
        mask = np.zeros((len(self.envs), self.n_actions), bool)
        for i, o in enumerate(self.obs):
            po = o["player_observations"][o["current_player"]]
            x[i] = po["vectorized"]
            mask[i, po["legal_moves_as_int"]] = True
        return x, mask

    def step(self, actions):
        rew, done = np.zeros(len(self.envs), np.float32), np.zeros(len(self.envs), np.float32)
        for i, (e, a) in enumerate(zip(self.envs, actions)):
            obs, r, d, _ = e.step(int(a))
            rew[i], done[i] = r, d
            self.ep_ret[i] += r
            if d:
                self.finished.append(self.ep_ret[i])
                self.ep_ret[i] = 0
                obs = e.reset()
            self.obs[i] = obs
        return rew, done

    def pop_finished(self):
        out, self.finished = self.finished, []
        return out


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=1024):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden // 2), nn.ReLU())
        self.pi = nn.Linear(hidden // 2, n_actions)
        self.v = nn.Linear(hidden // 2, 1)
        nn.init.orthogonal_(self.pi.weight, 0.01)
        nn.init.zeros_(self.pi.bias)

    def forward(self, x, mask):
        h = self.body(x)
        return self.pi(h).masked_fill(~mask, -1e8), self.v(h).squeeze(-1)


def gae(rew, val, done, last_val, gamma, lam):
    # two-player alternating turns with a shared policy: the team reward is the
    # same for both seats, so a plain single-agent GAE over the env's step
    # sequence is fine
    T = rew.shape[0]
    adv = torch.zeros_like(rew)
    last = torch.zeros_like(last_val)
    for t in reversed(range(T)):
        nv = last_val if t == T - 1 else val[t + 1]
        nonterm = 1.0 - done[t]
        delta = rew[t] + gamma * nv * nonterm - val[t]
        last = delta + gamma * lam * nonterm * last
        adv[t] = last
    return adv, adv + val


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--run-name", default="hanabi-ppo")
    p.add_argument("--total-updates", type=int, default=20000)
    p.add_argument("--envs-per-rank", type=int, default=256)
    p.add_argument("--rollout", type=int, default=80)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--gamma", type=float, default=0.999)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.1)
    p.add_argument("--ent", type=float, default=0.01)
    p.add_argument("--save-dir", default="/checkpoints/hanabi")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse()
    wandb.init(project="hanabi-selfplay", name=args.run_name, config=vars(args))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    envs = VecHanabi(args.envs_per_rank, seed=args.seed * 100_000 + rank * args.envs_per_rank)
    net = ActorCritic(envs.obs_dim, envs.n_actions).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    os.makedirs(args.save_dir, exist_ok=True)

    T, E = args.rollout, args.envs_per_rank
    b_obs = torch.zeros(T, E, envs.obs_dim, device=device)
    b_mask = torch.zeros(T, E, envs.n_actions, dtype=torch.bool, device=device)
    b_act = torch.zeros(T, E, dtype=torch.long, device=device)
    b_logp = torch.zeros(T, E, device=device)
    b_val = torch.zeros(T, E, device=device)
    b_rew = torch.zeros(T, E, device=device)
    b_done = torch.zeros(T, E, device=device)
    scores = []

    for update in range(args.total_updates):
        t0 = time.time()
        net.eval()
        for t in range(T):
            x, m = envs.current()
            b_obs[t] = torch.from_numpy(x).to(device)
            b_mask[t] = torch.from_numpy(m).to(device)
            with torch.no_grad():
                logits, v = net(b_obs[t], b_mask[t])
                d = torch.distributions.Categorical(logits=logits)
                a = d.sample()
            b_act[t], b_logp[t], b_val[t] = a, d.log_prob(a), v
            r, done = envs.step(a.cpu().numpy())
            b_rew[t] = torch.from_numpy(r).to(device)
            b_done[t] = torch.from_numpy(done).to(device)
        scores += envs.pop_finished()
        with torch.no_grad():
            x, m = envs.current()
            _, last_v = net(torch.from_numpy(x).to(device), torch.from_numpy(m).to(device))
        adv, ret = gae(b_rew, b_val, b_done, last_v, args.gamma, args.lam)

        flat = lambda z: z.reshape(T * E, *z.shape[2:])
        o, mk, ac, lp, ad, rt = map(flat, (b_obs, b_mask, b_act, b_logp, adv, ret))
        ad = (ad - ad.mean()) / (ad.std() + 1e-8)
        model.train()
        mb = T * E // args.minibatches
        stats = torch.zeros(4, device=device)
        for _ in range(args.epochs):
            perm = torch.randperm(T * E, device=device)
            for k in range(args.minibatches):
                idx = perm[k * mb:(k + 1) * mb]
                logits, v = model(o[idx], mk[idx])
                logp_all = F.log_softmax(logits, -1)
                new_lp = logp_all.gather(1, ac[idx, None]).squeeze(1)
                ratio = (new_lp - lp[idx]).exp()
                pg = -torch.min(ratio * ad[idx], ratio.clamp(1 - args.clip, 1 + args.clip) * ad[idx]).mean()
                vl = 0.5 * (v - rt[idx]).pow(2).mean()
                ent = -(logp_all.exp() * logp_all).sum(-1).mean()
                loss = pg + 0.5 * vl - args.ent * ent
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                stats += torch.stack([pg.detach(), vl.detach(), ent.detach(),
                                      ((ratio - 1).abs() > args.clip).float().mean()])
        stats /= args.epochs * args.minibatches

        score_t = torch.tensor([sum(scores), len(scores)], dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        dist.all_reduce(score_t)
        stats /= world
        if score_t[1] > 0:
            scores = []
        sps = T * E * world / (time.time() - t0)
        wandb.log({"loss/policy": stats[0].item(), "loss/value": stats[1].item(), "entropy": stats[2].item(),
                   "clipfrac": stats[3].item(), "score": (score_t[0] / score_t[1].clamp(min=1)).item(),
                   "episodes": score_t[1].item(), "sps": sps}, step=update)

        if rank == 0 and (update + 1) % args.save_every == 0:
            path = os.path.join(args.save_dir, f"{args.run_name}_{update + 1:06d}.pt")
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "update": update + 1}, path)
            print(f"update {update + 1}: saved {path}", flush=True)

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
