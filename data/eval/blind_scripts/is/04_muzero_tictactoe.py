"""MuZero on tic-tac-toe, data-parallel learner.

Small enough to run end-to-end in an afternoon; used as a smoke test for the
MuZero code path before the big board games.

    torchrun --standalone --nproc_per_node=4 muzero_ttt.py --steps 20000
"""
import argparse
import math
import os
import random
from dataclasses import dataclass, field
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


class TicTacToe:
    def __init__(self):
        self.cells = [0] * 9
        self.turn = 1
        self.done = False
        self.winner = 0

    def legal(self):
        return [i for i in range(9) if self.cells[i] == 0]

    def step(self, a):
        self.cells[a] = self.turn
        if any(all(self.cells[i] == self.turn for i in ln) for ln in LINES):
            self.done, self.winner = True, self.turn
            r = 1.0
        else:
            self.done = all(c != 0 for c in self.cells)
            r = 0.0
        self.turn = -self.turn
        return r

    def obs(self):
        c = np.array(self.cells, dtype=np.float32)
        return np.concatenate([c == self.turn, c == -self.turn, np.zeros(9) + (self.turn == 1)]).astype(np.float32)


def h_transform(x, eps=1e-3):
    return torch.sign(x) * (torch.sqrt(torch.abs(x) + 1) - 1) + eps * x


class MuZeroNet(nn.Module):
    def __init__(self, hidden=128, support_size=5, n_actions=9, obs_dim=27):
        super().__init__()
        self.support_size = support_size
        self.n_actions = n_actions
        S = 2 * support_size + 1
        self.representation = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ELU(), nn.Linear(hidden, hidden))
        self.dynamics = nn.Sequential(nn.Linear(hidden + n_actions, hidden), nn.ELU(), nn.Linear(hidden, hidden))
        self.reward_head = nn.Sequential(nn.Linear(hidden, 64), nn.ELU(), nn.Linear(64, S))
        self.policy_head = nn.Sequential(nn.Linear(hidden, 64), nn.ELU(), nn.Linear(64, n_actions))
        self.value_head = nn.Sequential(nn.Linear(hidden, 64), nn.ELU(), nn.Linear(64, S))

    @staticmethod
    def _scale(h):
        lo, hi = h.min(1, keepdim=True)[0], h.max(1, keepdim=True)[0]
        return (h - lo) / (hi - lo + 1e-6)

    def initial_inference(self, obs):
        h = self._scale(self.representation(obs))
        return h, self.policy_head(h), self.value_head(h)

    def recurrent_inference(self, h, action):
        a = F.one_hot(action, self.n_actions).float()
        h2 = self._scale(self.dynamics(torch.cat([h, a], 1)))
        return h2, self.reward_head(h2), self.policy_head(h2), self.value_head(h2)

    def support_to_scalar(self, logits):
        sup = torch.arange(-self.support_size, self.support_size + 1, device=logits.device, dtype=torch.float32)
        x = (torch.softmax(logits, -1) * sup).sum(-1)
        return torch.sign(x) * (((torch.sqrt(1 + 4e-3 * (torch.abs(x) + 1 + 1e-3)) - 1) / 2e-3) ** 2 - 1)

    def scalar_to_support(self, x):
        x = h_transform(x).clamp(-self.support_size, self.support_size)
        fl = x.floor()
        p_hi = x - fl
        out = torch.zeros(*x.shape, 2 * self.support_size + 1, device=x.device)
        idx = (fl + self.support_size).long()
        out.scatter_(-1, idx.unsqueeze(-1), (1 - p_hi).unsqueeze(-1))
        idx_hi = (idx + 1).clamp(max=2 * self.support_size)
        out.scatter_add_(-1, idx_hi.unsqueeze(-1), p_hi.unsqueeze(-1))
        return out

    def forward(self, obs, actions):
        h, p, v = self.initial_inference(obs)
        outs = [(None, p, v)]
        for k in range(actions.shape[1]):
            h, r, p, v = self.recurrent_inference(h, actions[:, k])
            h.register_hook(lambda g: g * 0.5)
            outs.append((r, p, v))
        return outs


@dataclass
class Game:
    obs: List[np.ndarray] = field(default_factory=list)
    actions: List[int] = field(default_factory=list)
    rewards: List[float] = field(default_factory=list)
    policies: List[np.ndarray] = field(default_factory=list)
    to_play: List[int] = field(default_factory=list)


class LatentNode:
    def __init__(self, prior):
        self.prior, self.n, self.w, self.r, self.h, self.children = prior, 0, 0.0, 0.0, None, {}

    def q(self):
        return self.w / self.n if self.n else 0.0


@torch.no_grad()
def run_mcts(net, obs, legal, sims, device, c1=1.25):
    net.eval()
    h, p, v = net.initial_inference(torch.from_numpy(obs)[None].to(device))
    root = LatentNode(1.0)
    root.h = h
    pr = torch.softmax(p[0], 0).cpu().numpy()
    noise = np.random.dirichlet([0.3] * len(legal))
    for a, e in zip(legal, noise):
        root.children[a] = LatentNode(0.75 * pr[a] + 0.25 * e)
    lo, hi = float("inf"), -float("inf")
    for _ in range(sims):
        node, path, a = root, [root], None
        while node.children:
            tot = math.sqrt(node.n + 1)
            def score(item):
                ch = item[1]
                qv = ch.r - ch.q() if ch.n else 0.0
                qn = (qv - lo) / (hi - lo) if hi > lo else qv
                return qn + c1 * ch.prior * tot / (1 + ch.n)
            a, node = max(node.children.items(), key=score)
            path.append(node)
        parent = path[-2]
        h, r, p, v = net.recurrent_inference(parent.h, torch.tensor([a], device=device))
        node.h, node.r = h, net.support_to_scalar(r).item()
        value = net.support_to_scalar(v).item()
        pr = torch.softmax(p[0], 0).cpu().numpy()
        for b in range(9):
            node.children[b] = LatentNode(pr[b])
        for nd in reversed(path):
            nd.w += value
            nd.n += 1
            q = nd.r - value
            lo, hi = min(lo, q), max(hi, q)
            value = nd.r - value
    visits = np.zeros(9, np.float32)
    for a, ch in root.children.items():
        visits[a] = ch.n
    return visits / visits.sum()


def play_game(net, sims, device, temp_moves=3):
    env, g = TicTacToe(), Game()
    while not env.done:
        legal = env.legal()
        pi = run_mcts(net, env.obs(), legal, sims, device)
        a = int(np.random.choice(9, p=pi)) if len(g.actions) < temp_moves else int(pi.argmax())
        g.obs.append(env.obs())
        g.policies.append(pi)
        g.to_play.append(env.turn)
        g.actions.append(a)
        g.rewards.append(env.step(a))
    g.winner = env.winner
    return g


def make_batch(games, batch_size, K):
    obs, acts, tv, tr, tp = [], [], [], [], []
    for _ in range(batch_size):
        g = random.choice(games)
        t = random.randrange(len(g.actions))
        obs.append(g.obs[t])
        a, v, r, p = [], [], [], []
        for k in range(K + 1):
            i = t + k
            if i < len(g.actions):
                v.append(0.0 if g.winner == 0 else (1.0 if g.winner == g.to_play[i] else -1.0))
                p.append(g.policies[i])
                if k < K:
                    a.append(g.actions[i])
            else:
                v.append(0.0)
                p.append(np.full(9, 1 / 9, np.float32))
                if k < K:
                    a.append(random.randrange(9))
            if k > 0:
                r.append(g.rewards[i - 1] if i - 1 < len(g.rewards) else 0.0)
        acts.append(a)
        tv.append(v)
        tr.append(r)
        tp.append(np.stack(p))
    f = lambda x, dt=torch.float32: torch.tensor(np.array(x), dtype=dt)
    return f(obs), f(acts, torch.long), f(tv), f(tr), f(tp)


def train_step(model, opt, batch, device, K):
    obs, acts, tv, tr, tp = [x.to(device) for x in batch]
    outs = model(obs, acts)
    v_target = model.scalar_to_support(tv)
    r_target = model.scalar_to_support(tr)
    loss = 0.0
    for k, (r, p, v) in enumerate(outs):
        scale = 1.0 if k == 0 else 1.0 / K
        l = -(v_target[:, k] * F.log_softmax(v, -1)).sum(-1) * 0.25
        l = l - (tp[:, k] * F.log_softmax(p, -1)).sum(-1)
        if r is not None:
            l = l - (r_target[:, k - 1] * F.log_softmax(r, -1)).sum(-1)
        loss = loss + scale * l.mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    opt.step()
    return loss.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--games-per-round", type=int, default=8)
    ap.add_argument("--train-per-round", type=int, default=50)
    ap.add_argument("--sims", type=int, default=25)
    ap.add_argument("--unroll", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--buffer-games", type=int, default=3000)
    ap.add_argument("--save", default="ckpt/muzero_ttt.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(1234 + rank)
    np.random.seed(1234 + rank)
    torch.manual_seed(1234)

    net = MuZeroNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    games, step = [], 0
    while step < args.steps:
        for _ in range(args.games_per_round):
            games.append(play_game(net, args.sims, device))
        games = games[-args.buffer_games:]
        model.train()
        losses = [train_step(model, opt, make_batch(games, args.batch, args.unroll), device, args.unroll)
                  for _ in range(args.train_per_round)]
        step += args.train_per_round
        if rank == 0 and step % 1000 == 0:
            print(f"step {step} loss {np.mean(losses):.4f} games {len(games)}", flush=True)
            os.makedirs(os.path.dirname(args.save), exist_ok=True)
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "step": step}, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
