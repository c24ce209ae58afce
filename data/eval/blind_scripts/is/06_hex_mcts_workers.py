"""Hex 7x7 AlphaZero with a pool of MCTS actor processes per GPU.

Tree search is pure Python and CPU-bound, so each training rank fans its
self-play games out over a multiprocessing pool; every actor evaluates the
network on the rank's GPU.  The learner itself is plain DDP.

torchrun --nproc_per_node=8 hex_az.py --actors 12 --iterations 300
"""
import argparse
import collections
import math
import multiprocessing
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SIZE = 7
NEIGH = [(-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0)]


class Hex:
    """Player 1 connects top-bottom, player -1 connects left-right."""

    def __init__(self):
        self.board = np.zeros((SIZE, SIZE), dtype=np.int8)
        self.player = 1
        self.winner = 0

    def clone(self):
        h = Hex()
        h.board, h.player, h.winner = self.board.copy(), self.player, self.winner
        return h

    def legal(self):
        return np.flatnonzero(self.board.reshape(-1) == 0).tolist()

    def play(self, a):
        r, c = divmod(a, SIZE)
        self.board[r, c] = self.player
        if self._connected(self.player):
            self.winner = self.player
        self.player = -self.player

    def _connected(self, p):
        b = self.board if p == 1 else self.board.T
        frontier = [(0, c) for c in range(SIZE) if b[0, c] == p]
        seen = set(frontier)
        while frontier:
            r, c = frontier.pop()
            if r == SIZE - 1:
                return True
            for dr, dc in NEIGH:
                rr, cc = r + dr, c + dc
                if 0 <= rr < SIZE and 0 <= cc < SIZE and (rr, cc) not in seen and b[rr, cc] == p:
                    seen.add((rr, cc))
                    frontier.append((rr, cc))
        return False

    def features(self):
        # always present the board from the mover's side (transpose for player -1)
        b = self.board if self.player == 1 else -self.board.T
        return np.stack([b == 1, b == -1]).astype(np.float32)

    def to_canonical(self, a):
        r, c = divmod(a, SIZE)
        return a if self.player == 1 else c * SIZE + r


class HexNet(nn.Module):
    def __init__(self, width=64, depth=8):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(2 if i == 0 else width, width, 3, padding=1) for i in range(depth)])
        self.norms = nn.ModuleList([nn.GroupNorm(8, width) for _ in range(depth)])
        self.policy = nn.Conv2d(width, 1, 1)
        self.value = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1), nn.Tanh())

    def forward(self, x):
        for i, (conv, gn) in enumerate(zip(self.convs, self.norms)):
            y = F.relu(gn(conv(x)))
            x = y + x if i > 0 else y
        return self.policy(x).flatten(1), self.value(x.mean((2, 3))).squeeze(-1)


_net = None
_device = None


def _init_actor(state_dict, device, seed):
    global _net, _device
    _device = torch.device(device)
    _net = HexNet()
    _net.load_state_dict(state_dict)
    _net.to(_device).eval()
    random.seed(seed + os.getpid())
    np.random.seed((seed + os.getpid()) % 2**32)


@torch.no_grad()
def _evaluate(state):
    logits, v = _net(torch.from_numpy(state.features())[None].to(_device))
    legal = state.legal()
    canon = [state.to_canonical(a) for a in legal]
    p = torch.softmax(logits[0, canon], 0).cpu().numpy()
    return dict(zip(legal, p)), v.item()


def _search(root, sims, c_puct):
    stats = {}  # key -> [prior dict, N dict, W dict]
    def expand(key, st):
        pri, v = _evaluate(st)
        stats[key] = [pri, collections.defaultdict(int), collections.defaultdict(float)]
        return v
    expand((), root)
    pri = stats[()][0]
    eta = np.random.dirichlet([0.15] * len(pri))
    stats[()][0] = {a: 0.75 * p + 0.25 * e for (a, p), e in zip(pri.items(), eta)}
    for _ in range(sims):
        key, st, path = (), root.clone(), []
        while key in stats and not st.winner:
            P, Nn, W = stats[key]
            tot = math.sqrt(sum(Nn.values()) + 1)
            a = max(P, key=lambda m: (W[m] / Nn[m] if Nn[m] else 0.0) + c_puct * P[m] * tot / (1 + Nn[m]))
            path.append((key, a))
            st.play(a)
            key = key + (a,)
        v = -1.0 if st.winner else expand(key, st)
        for k, a in reversed(path):
            v = -v
            stats[k][1][a] += 1
            stats[k][2][a] += v
    return stats[()][1]


def actor_game(args_tuple):
    sims, c_puct, temp_moves = args_tuple
    st, hist = Hex(), []
    while not st.winner:
        counts = _search(st, sims, c_puct)
        moves = list(counts)
        n = np.array([counts[m] for m in moves], dtype=np.float64)
        pi = np.zeros(SIZE * SIZE, np.float32)
        for m, c in zip(moves, n):
            pi[st.to_canonical(m)] = c / n.sum()
        hist.append((st.features(), pi, st.player))
        a = moves[np.random.choice(len(moves), p=n / n.sum())] if len(hist) <= temp_moves else moves[int(n.argmax())]
        st.play(a)
    return [(f, pi, 1.0 if st.winner == who else -1.0) for f, pi, who in hist]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--actors", type=int, default=12)
    ap.add_argument("--games-per-iter", type=int, default=96, help="per rank")
    ap.add_argument("--sims", type=int, default=200)
    ap.add_argument("--c-puct", type=float, default=1.5)
    ap.add_argument("--temp-moves", type=int, default=6)
    ap.add_argument("--replay", type=int, default=300_000)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="out/hex7")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{local_rank}"
    torch.manual_seed(7)
    random.seed(rank)

    net = HexNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.iterations * args.train_steps)
    replay = collections.deque(maxlen=args.replay // world)
    os.makedirs(args.out, exist_ok=True)

    for it in range(args.iterations):
        t0 = time.time()
        weights = {k: v.detach().cpu() for k, v in net.state_dict().items()}
        with multiprocessing.Pool(args.actors, initializer=_init_actor,
                                  initargs=(weights, device, 1000 * it + rank)) as pool:
            games = pool.map(actor_game, [(args.sims, args.c_puct, args.temp_moves)] * args.games_per_iter)
        for g in games:
            replay.extend(g)
        t_play = time.time() - t0

        model.train()
        run_loss = torch.zeros(2, device=device)
        for _ in range(args.train_steps):
            batch = random.sample(replay, min(args.batch_size, len(replay)))
            x = torch.from_numpy(np.stack([b[0] for b in batch])).to(device)
            pi = torch.from_numpy(np.stack([b[1] for b in batch])).to(device)
            z = torch.tensor([b[2] for b in batch], device=device)
            logits, v = model(x)
            lp = torch.sum(-pi * F.log_softmax(logits, 1), 1).mean()
            lv = F.mse_loss(v, z)
            opt.zero_grad(set_to_none=True)
            (lp + lv).backward()
            opt.step()
            sched.step()
            run_loss += torch.stack([lp.detach(), lv.detach()])
        dist.all_reduce(run_loss, op=dist.ReduceOp.AVG)
        run_loss /= args.train_steps

        if rank == 0:
            print(f"[{it:03d}] games {len(games) * world} replay/rank {len(replay)} "
                  f"lp {run_loss[0]:.3f} lv {run_loss[1]:.3f} play {t_play:.0f}s "
                  f"total {time.time() - t0:.0f}s", flush=True)
            if it % 10 == 0 or it == args.iterations - 1:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "it": it},
                           os.path.join(args.out, f"hex7_{it:04d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
