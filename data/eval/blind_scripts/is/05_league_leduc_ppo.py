#!/usr/bin/env python3
"""League PPO for Leduc hold'em (OpenSpiel).

The learning agent plays against opponents drawn from a pool of its own past
snapshots (prioritised fictitious self-play).  Rollouts run on every rank on
CPU with the policy on GPU, the PPO update is data parallel.

  torchrun --nproc_per_node=4 league_leduc.py --run-dir /mnt/shared/leduc/league01
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import pyspiel
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class PolicyNet(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(),
                                   nn.Linear(hidden, hidden), nn.ReLU())
        self.pi = nn.Linear(hidden, n_actions)
        self.v = nn.Linear(hidden, 1)

    def forward(self, obs, mask):
        h = self.trunk(obs)
        logits = self.pi(h).masked_fill(~mask, -1e9)
        return logits, self.v(h).squeeze(-1)


def act(net, state, player, device, greedy=False):
    obs = torch.tensor(state.information_state_tensor(player), dtype=torch.float32, device=device)
    mask = torch.tensor(state.legal_actions_mask(player), dtype=torch.bool, device=device)
    with torch.no_grad():
        logits, v = net(obs[None], mask[None])
    dist_ = torch.distributions.Categorical(logits=logits[0])
    a = logits[0].argmax() if greedy else dist_.sample()
    return int(a), float(dist_.log_prob(a)), float(v[0]), obs.cpu(), mask.cpu()


def play_episode(game, learner, opponent, learner_seat, device):
    state = game.new_initial_state()
    traj = []
    while not state.is_terminal():
        if state.is_chance_node():
            outcomes, probs = zip(*state.chance_outcomes())
            state.apply_action(int(np.random.choice(outcomes, p=probs)))
            continue
        p = state.current_player()
        if p == learner_seat:
            a, logp, v, obs, mask = act(learner, state, p, device)
            traj.append([obs, mask, a, logp, v])
        else:
            a = act(opponent, state, p, device)[0]
        state.apply_action(a)
    ret = state.returns()[learner_seat]
    for step in traj:
        step.append(ret)
    return traj, ret


class League:
    def __init__(self, pool_dir, template, device):
        self.pool_dir, self.template, self.device = pool_dir, template, device
        self.stats = {}  # path -> [games, learner wins]

    def members(self):
        return sorted(glob.glob(os.path.join(self.pool_dir, "agent_*.pt")))

    def sample(self):
        pool = self.members()
        if not pool:
            return None, None
        # PFSP "hard" weighting: prefer opponents we still lose against
        w = []
        for p in pool:
            g, won = self.stats.get(p, [0, 0])
            wr = (won + 1) / (g + 2)
            w.append((1 - wr) ** 2 + 1e-3)
        path = random.choices(pool, weights=w)[0]
        net = self.template()
        net.load_state_dict(torch.load(path, map_location="cpu")["policy"])
        return path, net.to(self.device).eval()

    def record(self, path, ret):
        s = self.stats.setdefault(path, [0, 0])
        s[0] += 1
        s[1] += ret > 0

    def add_snapshot(self, net, it):
        path = os.path.join(self.pool_dir, f"agent_{it:06d}.pt")
        torch.save({"policy": net.state_dict(), "iter": it}, path)
        return path


def ppo_update(model, opt, batch, args):
    obs, mask, act_, old_logp, old_v, ret = batch
    adv = ret - old_v
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    n = obs.shape[0]
    stats = torch.zeros(3, device=obs.device)
    for _ in range(args.ppo_epochs):
        perm = torch.randperm(n, device=obs.device)
        for i in range(0, n, args.minibatch):
            idx = perm[i:i + args.minibatch]
            logits, v = model(obs[idx], mask[idx])
            logp_all = F.log_softmax(logits, -1)
            logp = logp_all.gather(1, act_[idx, None]).squeeze(1)
            ratio = torch.exp(logp - old_logp[idx])
            pg = -torch.min(ratio * adv[idx], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[idx]).mean()
            vl = F.mse_loss(v, ret[idx])
            ent = -(logp_all.exp() * logp_all).sum(-1).mean()
            loss = pg + args.vf_coef * vl - args.ent_coef * ent
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            stats += torch.stack([pg.detach(), vl.detach(), ent.detach()])
    return stats / (args.ppo_epochs * ((n + args.minibatch - 1) // args.minibatch))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--iterations", type=int, default=5000)
    ap.add_argument("--steps-per-rank", type=int, default=4096)
    ap.add_argument("--minibatch", type=int, default=1024)
    ap.add_argument("--ppo-epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--vf-coef", type=float, default=0.5)
    ap.add_argument("--ent-coef", type=float, default=0.01)
    ap.add_argument("--snapshot-every", type=int, default=25)
    ap.add_argument("--selfplay-prob", type=float, default=0.35)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    game = pyspiel.load_game("leduc_poker")
    obs_dim, n_actions = game.information_state_tensor_size(), game.num_distinct_actions()
    template = lambda: PolicyNet(obs_dim, n_actions)
    pool_dir = os.path.join(args.run_dir, "pool")
    os.makedirs(pool_dir, exist_ok=True)

    net = template().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    league = League(pool_dir, template, device)
    ckpt = os.path.join(args.run_dir, "learner.pt")
    start = 0
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, map_location=device)
        net.load_state_dict(sd["policy"])
        opt.load_state_dict(sd["opt"])
        start = sd["iter"] + 1

    for it in range(start, args.iterations):
        t0 = time.time()
        net.eval()
        buf, rets = [], []
        while len(buf) < args.steps_per_rank:
            if random.random() < args.selfplay_prob:
                opp_path, opp = None, net
            else:
                opp_path, opp = league.sample()
                if opp is None:
                    opp_path, opp = None, net
            seat = random.randrange(2)
            traj, ret = play_episode(game, net, opp, seat, device)
            buf += traj
            rets.append(ret)
            if opp_path is not None:
                league.record(opp_path, ret)
        buf = buf[:args.steps_per_rank]

        obs = torch.stack([b[0] for b in buf]).to(device)
        mask = torch.stack([b[1] for b in buf]).to(device)
        acts = torch.tensor([b[2] for b in buf], device=device)
        logp = torch.tensor([b[3] for b in buf], device=device)
        vals = torch.tensor([b[4] for b in buf], device=device)
        ret = torch.tensor([b[5] for b in buf], dtype=torch.float32, device=device)

        model.train()
        stats = ppo_update(model, opt, (obs, mask, acts, logp, vals, ret), args)
        summary = torch.tensor([float(np.sum(rets)), float(len(rets))], device=device)
        dist.all_reduce(stats)
        dist.all_reduce(summary)
        stats /= dist.get_world_size()

        if it % args.snapshot_every == 0:
            league.add_snapshot(net, it)

        if rank == 0:
            pg, vl, ent = stats.tolist()
            print(f"it {it:5d} | mean return {summary[0].item() / summary[1].item():+.3f} "
                  f"| pg {pg:+.4f} vf {vl:.4f} ent {ent:.3f} | pool {len(league.members())} "
                  f"| {time.time() - t0:.1f}s", flush=True)
            torch.save({"policy": net.state_dict(), "opt": opt.state_dict(), "iter": it}, ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
