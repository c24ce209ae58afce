#!/usr/bin/env python3
"""AlphaZero-style Connect Four training with DDP.

Every rank runs its own self-play games on its GPU, keeps a local replay
window and trains the shared network with DDP.  After each iteration the
candidate is evaluated against the current best network and promoted if it
wins more than --gate of the evaluation games.
"""
import argparse
import logging
import math
import os
import random
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ROWS, COLS = 6, 7
log = logging.getLogger("c4az")


class ConnectFour:
    def __init__(self):
        self.board = np.zeros((ROWS, COLS), dtype=np.int8)
        self.heights = np.zeros(COLS, dtype=np.int64)
        self.player = 1
        self.winner = None
        self.moves = 0

    def clone(self):
        g = ConnectFour.__new__(ConnectFour)
        g.board, g.heights = self.board.copy(), self.heights.copy()
        g.player, g.winner, g.moves = self.player, self.winner, self.moves
        return g

    def legal_moves(self):
        return [c for c in range(COLS) if self.heights[c] < ROWS]

    def play(self, col):
        r = self.heights[col]
        self.board[r, col] = self.player
        self.heights[col] += 1
        self.moves += 1
        if self._connects(r, col):
            self.winner = self.player
        elif self.moves == ROWS * COLS:
            self.winner = 0
        self.player = -self.player

    def _connects(self, r, c):
        p = self.board[r, c]
        for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
            n = 1
            for s in (1, -1):
                rr, cc = r + s * dr, c + s * dc
                while 0 <= rr < ROWS and 0 <= cc < COLS and self.board[rr, cc] == p:
                    n += 1
                    rr, cc = rr + s * dr, cc + s * dc
            if n >= 4:
                return True
        return False

    def done(self):
        return self.winner is not None

    def encode(self):
        return np.stack([self.board == self.player, self.board == -self.player]).astype(np.float32)


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.c1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(ch)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(ch)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(y)))


class PolicyValueNet(nn.Module):
    def __init__(self, channels=64, blocks=6):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        self.tower = nn.Sequential(*[ResBlock(channels) for _ in range(blocks)])
        self.p_head = nn.Sequential(nn.Conv2d(channels, 2, 1), nn.BatchNorm2d(2), nn.ReLU(),
                                    nn.Flatten(), nn.Linear(2 * ROWS * COLS, COLS))
        self.v_head = nn.Sequential(nn.Conv2d(channels, 1, 1), nn.BatchNorm2d(1), nn.ReLU(),
                                    nn.Flatten(), nn.Linear(ROWS * COLS, 64), nn.ReLU(),
                                    nn.Linear(64, 1), nn.Tanh())

    def forward(self, x):
        h = self.tower(self.stem(x))
        return self.p_head(h), self.v_head(h).squeeze(-1)


class Node:
    __slots__ = ("prior", "visits", "value_sum", "children")

    def __init__(self, prior):
        self.prior, self.visits, self.value_sum, self.children = prior, 0, 0.0, {}

    def value(self):
        return self.value_sum / self.visits if self.visits else 0.0


@torch.no_grad()
def evaluate_position(net, game, device):
    x = torch.from_numpy(game.encode()).unsqueeze(0).to(device)
    logits, v = net(x)
    mask = torch.full((COLS,), float("-inf"), device=device)
    mask[game.legal_moves()] = 0.0
    return torch.softmax(logits[0] + mask, -1).cpu().numpy(), v.item()


def mcts(net, root_game, sims, c_puct, device, noise=True, alpha=1.0, eps=0.25):
    root = Node(1.0)
    p, _ = evaluate_position(net, root_game, device)
    legal = root_game.legal_moves()
    dn = np.random.dirichlet([alpha] * len(legal)) if noise else None
    for i, a in enumerate(legal):
        root.children[a] = Node((1 - eps) * p[a] + eps * dn[i] if noise else p[a])
    for _ in range(sims):
        node, game, path = root, root_game.clone(), [root]
        while node.children:
            sq = math.sqrt(node.visits + 1)
            a, node = max(node.children.items(),
                          key=lambda kv: -kv[1].value() + c_puct * kv[1].prior * sq / (1 + kv[1].visits))
            game.play(a)
            path.append(node)
        if game.done():
            v = 0.0 if game.winner == 0 else -1.0
        else:
            p, v = evaluate_position(net, game, device)
            for a in game.legal_moves():
                node.children[a] = Node(p[a])
        for n in reversed(path):
            n.visits += 1
            n.value_sum += v
            v = -v
    visits = np.zeros(COLS, dtype=np.float32)
    for a, ch in root.children.items():
        visits[a] = ch.visits
    return visits


def self_play_game(net, args, device):
    game, hist = ConnectFour(), []
    while not game.done():
        visits = mcts(net, game, args.sims, args.c_puct, device)
        pi = visits / visits.sum()
        hist.append((game.encode(), pi, game.player))
        a = np.random.choice(COLS, p=pi) if game.moves < args.temp_moves else int(visits.argmax())
        game.play(a)
    return [(s, pi, 0.0 if game.winner == 0 else (1.0 if game.winner == pl else -1.0))
            for s, pi, pl in hist]


def play_match(net_a, net_b, a_first, args, device):
    """Returns +1 if net_a wins, 0 draw, -1 loss."""
    game = ConnectFour()
    players = {1: net_a, -1: net_b} if a_first else {1: net_b, -1: net_a}
    while not game.done():
        visits = mcts(players[game.player], game, args.eval_sims, args.c_puct, device, noise=False)
        game.play(int(visits.argmax()))
    if game.winner == 0:
        return 0
    return 1 if players[game.winner] is net_a else -1


def evaluate_vs_best(candidate, best, args, device, rank):
    candidate.eval()
    best.eval()
    wins = draws = losses = 0
    for g in range(args.eval_games_per_rank):
        r = play_match(candidate, best, a_first=(g + rank) % 2 == 0, args=args, device=device)
        wins += r == 1
        draws += r == 0
        losses += r == -1
    stats = torch.tensor([wins, draws, losses], dtype=torch.float64)
    dist.all_reduce(stats)
    w, d, l = stats.tolist()
    return (w + 0.5 * d) / max(w + d + l, 1), (w, d, l)


def train_steps(model, opt, buffer, args, device):
    model.train()
    tot_p = tot_v = 0.0
    for _ in range(args.steps_per_iter):
        batch = random.choices(buffer, k=args.batch_size)
        s = torch.from_numpy(np.stack([b[0] for b in batch])).to(device, non_blocking=True)
        pi = torch.from_numpy(np.stack([b[1] for b in batch])).to(device, non_blocking=True)
        z = torch.tensor([b[2] for b in batch], dtype=torch.float32, device=device)
        logits, v = model(s)
        p_loss = -(pi * F.log_softmax(logits, -1)).sum(-1).mean()
        v_loss = F.mse_loss(v, z)
        opt.zero_grad(set_to_none=True)
        (p_loss + v_loss).backward()
        opt.step()
        tot_p += p_loss.item()
        tot_v += v_loss.item()
    return tot_p / args.steps_per_iter, tot_v / args.steps_per_iter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--games-per-rank", type=int, default=16)
    ap.add_argument("--sims", type=int, default=100)
    ap.add_argument("--eval-sims", type=int, default=50)
    ap.add_argument("--eval-games-per-rank", type=int, default=8)
    ap.add_argument("--c-puct", type=float, default=1.5)
    ap.add_argument("--temp-moves", type=int, default=10)
    ap.add_argument("--buffer-size", type=int, default=50_000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps-per-iter", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gate", type=float, default=0.55)
    ap.add_argument("--ckpt-dir", default="checkpoints/c4")
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)

    net = PolicyValueNet().to(device)
    best = PolicyValueNet().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    start_it = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        net.load_state_dict(ck["model"])
        best.load_state_dict(ck["best"])
        opt.load_state_dict(ck["optim"])
        start_it = ck["iteration"] + 1
    else:
        best.load_state_dict(net.state_dict())
    model = DDP(net, device_ids=[local_rank])
    buffer = deque(maxlen=args.buffer_size // world)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for it in range(start_it, args.iterations):
        t0 = time.time()
        net.eval()
        n_pos = 0
        for _ in range(args.games_per_rank):
            samples = self_play_game(net, args, device)
            buffer.extend(samples)
            n_pos += len(samples)
        t_sp = time.time() - t0

        p_loss, v_loss = train_steps(model, opt, buffer, args, device)
        score, (w, d, l) = evaluate_vs_best(net, best, args, device, rank)
        promoted = score > args.gate
        if promoted:
            best.load_state_dict(net.state_dict())
        log.info("it %d | selfplay %.1fs (%d pos) | p %.3f v %.3f | eval %.3f (%d/%d/%d)%s",
                 it, t_sp, n_pos, p_loss, v_loss, score, w, d, l, " promoted" if promoted else "")

        if rank == 0:
            torch.save({"model": net.state_dict(), "best": best.state_dict(),
                        "optim": opt.state_dict(), "iteration": it, "args": vars(args)},
                       os.path.join(args.ckpt_dir, "last.pt"))
            if promoted:
                torch.save(best.state_dict(), os.path.join(args.ckpt_dir, f"best_{it:04d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
