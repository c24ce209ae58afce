"""AlphaZero-style Connect4: self-play on every GPU, DDP training, arena gating.

torchrun --nproc_per_node=4 07_selfplay_checkpoint_gate.py --iters 200
"""
import argparse
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

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=200)
p.add_argument("--games-per-rank", type=int, default=25)
p.add_argument("--arena-games-per-rank", type=int, default=10)
p.add_argument("--sims", type=int, default=100)
p.add_argument("--train-steps", type=int, default=400)
p.add_argument("--batch-size", type=int, default=256)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--buffer", type=int, default=200_000)
p.add_argument("--gate", type=float, default=0.55)
p.add_argument("--ckpt-dir", default="c4_ckpt")


# --------------------------------------------------------------------------- game
class Connect4:
    def __init__(self):
        self.board = np.zeros((ROWS, COLS), dtype=np.int8)
        self.player = 1

    def copy(self):
        g = Connect4()
        g.board = self.board.copy()
        g.player = self.player
        return g

    def legal(self):
        return [c for c in range(COLS) if self.board[0, c] == 0]

    def play(self, col):
        row = max(r for r in range(ROWS) if self.board[r, col] == 0)
        self.board[row, col] = self.player
        self.player = -self.player
        return row

    def winner(self):
        b = self.board
        for r in range(ROWS):
            for c in range(COLS):
                v = b[r, c]
                if v == 0:
                    continue
                for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
                    rr, cc = r + 3 * dr, c + 3 * dc
                    if 0 <= rr < ROWS and 0 <= cc < COLS and all(b[r + k * dr, c + k * dc] == v for k in range(4)):
                        return v
        return 0 if self.legal() else 2  # 2 = draw

    def encode(self):
        # from the point of view of the player to move
        me = (self.board == self.player).astype(np.float32)
        op = (self.board == -self.player).astype(np.float32)
        return np.stack([me, op])


# --------------------------------------------------------------------------- net
class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(ch, ch, 3, padding=1), nn.GroupNorm(8, ch)
        self.c2, self.n2 = nn.Conv2d(ch, ch, 3, padding=1), nn.GroupNorm(8, ch)

    def forward(self, x):
        y = F.relu(self.n1(self.c1(x)))
        return F.relu(x + self.n2(self.c2(y)))


class C4Net(nn.Module):
    def __init__(self, ch=128, blocks=6):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, ch, 3, padding=1), nn.GroupNorm(8, ch), nn.ReLU())
        self.body = nn.Sequential(*[ResBlock(ch) for _ in range(blocks)])
        self.pol = nn.Sequential(nn.Conv2d(ch, 4, 1), nn.Flatten(), nn.Linear(4 * ROWS * COLS, COLS))
        self.val = nn.Sequential(nn.Conv2d(ch, 2, 1), nn.Flatten(), nn.Linear(2 * ROWS * COLS, 64), nn.ReLU(),
                                 nn.Linear(64, 1), nn.Tanh())

    def forward(self, x):
        h = self.body(self.stem(x))
        return self.pol(h), self.val(h).squeeze(-1)


# --------------------------------------------------------------------------- mcts
class Node:
    __slots__ = ("prior", "children", "N", "W")

    def __init__(self, prior):
        self.prior, self.children, self.N, self.W = prior, {}, 0, 0.0


@torch.no_grad()
def evaluate_state(net, game, device):
    x = torch.from_numpy(game.encode())[None].to(device)
    logits, v = net(x)
    probs = F.softmax(logits[0], -1).cpu().numpy()
    legal = game.legal()
    mask = np.zeros(COLS)
    mask[legal] = 1
    probs = probs * mask
    probs /= probs.sum() + 1e-8
    return probs, v.item()


def mcts(net, root_game, sims, device, noise=True):
    root = Node(1.0)
    probs, _ = evaluate_state(net, root_game, device)
    if noise:
        probs = 0.75 * probs + 0.25 * np.random.dirichlet([1.0] * COLS)
    for a in root_game.legal():
        root.children[a] = Node(probs[a])
    for _ in range(sims):
        node, game, path = root, root_game.copy(), [root]
        while node.children:
            total = math.sqrt(node.N + 1)
            a, node = max(node.children.items(),
                          key=lambda kv: (kv[1].W / kv[1].N if kv[1].N else 0.0) + 1.5 * kv[1].prior * total / (1 + kv[1].N))
            game.play(a)
            path.append(node)
        w = game.winner()
        if w == 0:
            pr, value = evaluate_state(net, game, device)
            for a in game.legal():
                node.children[a] = Node(pr[a])
        else:
            value = 0.0 if w == 2 else -1.0  # the previous player made the winning move
        for n in reversed(path):
            n.N += 1
            n.W += -value
            value = -value
    visits = np.zeros(COLS, dtype=np.float32)
    for a, ch in root.children.items():
        visits[a] = ch.N
    return visits / visits.sum()


def self_play_game(net, sims, device):
    game, history = Connect4(), []
    move = 0
    while True:
        pi = mcts(net, game, sims, device)
        history.append((game.encode(), pi, game.player))
        a = np.random.choice(COLS, p=pi) if move < 10 else int(pi.argmax())
        game.play(a)
        move += 1
        w = game.winner()
        if w != 0:
            z = 0.0 if w == 2 else float(w)
            return [(s, pi_, z * pl) for s, pi_, pl in history]


def arena(new_net, old_net, n_games, sims, device):
    wins = 0.0
    for g in range(n_games):
        game = Connect4()
        players = {1: new_net, -1: old_net} if g % 2 == 0 else {1: old_net, -1: new_net}
        while game.winner() == 0:
            pi = mcts(players[game.player], game, sims, device, noise=False)
            game.play(int(pi.argmax()))
        w = game.winner()
        if w == 2:
            wins += 0.5
        elif players[w] is new_net:
            wins += 1
    return wins


def main():
    args = p.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank * 10007 + int(time.time()) % 1000)
    random.seed(rank)
    torch.manual_seed(0)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    best_path = os.path.join(args.ckpt_dir, "best.pt")

    model = DDP(C4Net().to(device), device_ids=[local_rank])
    best_net = C4Net().to(device).eval()
    best_net.load_state_dict(model.module.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    buffer = deque(maxlen=args.buffer // world)

    for it in range(args.iters):
        t0 = time.time()
        for _ in range(args.games_per_rank):
            buffer.extend(self_play_game(best_net, args.sims, device))

        model.train()
        for step in range(args.train_steps):
            batch = random.sample(buffer, min(args.batch_size, len(buffer)))
            s = torch.from_numpy(np.stack([b[0] for b in batch])).to(device)
            pi = torch.from_numpy(np.stack([b[1] for b in batch])).to(device)
            z = torch.tensor([b[2] for b in batch], dtype=torch.float32, device=device)
            logits, v = model(s)
            loss = -(pi * F.log_softmax(logits, -1)).sum(-1).mean() + F.mse_loss(v, z)
            opt.zero_grad()
            loss.backward()
            opt.step()

        model.eval()
        wins = torch.tensor([arena(model.module, best_net, args.arena_games_per_rank, args.sims, device)],
                            device=device)
        dist.all_reduce(wins)
        win_rate = wins.item() / (args.arena_games_per_rank * world)
        accepted = win_rate >= args.gate
        if accepted:
            torch.save(model.module.state_dict(), best_path)
            best_net.load_state_dict(torch.load(best_path, map_location=device))

        if rank == 0:
            print(f"iter {it}: buffer {len(buffer)} loss {loss.item():.3f} arena {win_rate:.2f} "
                  f"{'ACCEPT' if accepted else 'reject'} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"iter": it, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.ckpt_dir, "last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
