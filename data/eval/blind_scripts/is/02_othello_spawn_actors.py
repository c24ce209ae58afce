"""
6x6 Othello self-play trainer (AlphaZero recipe), launched with mp.spawn.

Each process owns one GPU.  Per iteration every process plays its share of
self-play games, the new positions are exchanged with all_gather_object so
that all ranks hold the same replay window, and the window is then split
between ranks with a DistributedSampler for the SGD phase.

usage: python othello_spawn.py --gpus 4 --iters 100
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

N = 6
PASS = N * N
DIRS = [(-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1)]


class Othello:
    def __init__(self):
        self.b = np.zeros((N, N), np.int8)
        m = N // 2
        self.b[m - 1, m - 1] = self.b[m, m] = -1
        self.b[m - 1, m] = self.b[m, m - 1] = 1
        self.to_move = 1
        self.passes = 0

    def copy(self):
        o = Othello.__new__(Othello)
        o.b, o.to_move, o.passes = self.b.copy(), self.to_move, self.passes
        return o

    def _flips(self, r, c, p):
        out = []
        for dr, dc in DIRS:
            line, rr, cc = [], r + dr, c + dc
            while 0 <= rr < N and 0 <= cc < N and self.b[rr, cc] == -p:
                line.append((rr, cc))
                rr += dr
                cc += dc
            if line and 0 <= rr < N and 0 <= cc < N and self.b[rr, cc] == p:
                out += line
        return out

    def legal(self):
        mv = [r * N + c for r in range(N) for c in range(N)
              if self.b[r, c] == 0 and self._flips(r, c, self.to_move)]
        return mv or [PASS]

    def play(self, a):
        if a == PASS:
            self.passes += 1
        else:
            r, c = divmod(a, N)
            for rr, cc in self._flips(r, c, self.to_move):
                self.b[rr, cc] = self.to_move
            self.b[r, c] = self.to_move
            self.passes = 0
        self.to_move = -self.to_move

    def over(self):
        return self.passes >= 2 or not (self.b == 0).any()

    def result(self, player):
        d = int((self.b == player).sum() - (self.b == -player).sum())
        return float(np.sign(d))

    def planes(self):
        return np.stack([self.b == self.to_move, self.b == -self.to_move]).astype(np.float32)


class Net(nn.Module):
    def __init__(self, ch=96, blocks=5):
        super().__init__()
        layers = [nn.Conv2d(2, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU()]
        for _ in range(blocks):
            layers += [nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.pi = nn.Sequential(nn.Flatten(), nn.Linear(ch * N * N, PASS + 1))
        self.v = nn.Sequential(nn.Conv2d(ch, 4, 1), nn.ReLU(), nn.Flatten(),
                               nn.Linear(4 * N * N, 128), nn.ReLU(), nn.Linear(128, 1), nn.Tanh())

    def forward(self, x):
        h = self.body(x)
        return self.pi(h), self.v(h).squeeze(1)


@torch.no_grad()
def infer(net, state, device):
    logits, v = net(torch.from_numpy(state.planes())[None].to(device))
    legal = state.legal()
    p = torch.softmax(logits[0, legal], 0).cpu().numpy()
    return dict(zip(legal, p)), float(v)


def search(net, root_state, n_sim, device, c_puct=1.25, noise=True):
    # tree stored as dict: key = tuple of moves
    P, Nv, W = {}, {}, {}
    P[()], _ = infer(net, root_state, device)
    if noise:
        moves = list(P[()])
        eta = np.random.dirichlet([0.5] * len(moves))
        P[()] = {m: 0.75 * P[()][m] + 0.25 * e for m, e in zip(moves, eta)}
    for _ in range(n_sim):
        key, st, path = (), root_state.copy(), []
        while key in P and not st.over():
            tot = sum(Nv.get(key + (m,), 0) for m in P[key])
            best = max(P[key], key=lambda m: (W.get(key + (m,), 0.0) / Nv[key + (m,)] if Nv.get(key + (m,)) else 0.0)
                       + c_puct * P[key][m] * math.sqrt(tot + 1) / (1 + Nv.get(key + (m,), 0)))
            st.play(best)
            key = key + (best,)
            path.append(key)
        if st.over():
            v = st.result(st.to_move)
        else:
            P[key], v = infer(net, st, device)
        for k in reversed(path):
            v = -v
            Nv[k] = Nv.get(k, 0) + 1
            W[k] = W.get(k, 0.0) + v
    pi = np.zeros(PASS + 1, np.float32)
    for m in P[()]:
        pi[m] = Nv.get((m,), 0)
    return pi / pi.sum()


def play_one(net, cfg, device):
    st, traj, ply = Othello(), [], 0
    while not st.over():
        pi = search(net, st, cfg.sims, device)
        traj.append((st.planes(), pi, st.to_move))
        a = np.random.choice(len(pi), p=pi) if ply < cfg.explore_plies else int(pi.argmax())
        st.play(a)
        ply += 1
    return [(s, p, st.result(who)) for s, p, who in traj]


class Window(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, p, z = self.items[i]
        return torch.from_numpy(s), torch.from_numpy(p), torch.tensor(z, dtype=torch.float32)


def setup(rank, world_size, port):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def worker(rank, world_size, cfg):
    setup(rank, world_size, cfg.port)
    device = torch.device(f"cuda:{rank}")
    random.seed(cfg.seed * 1000 + rank)
    np.random.seed(cfg.seed * 1000 + rank)
    torch.manual_seed(cfg.seed)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(Net()).to(device)
    ddp = DDP(net, device_ids=[rank], output_device=rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    window, it0 = [], 0
    ckpt_path = os.path.join(cfg.out, "latest.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["net"])
        opt.load_state_dict(ck["opt"])
        it0 = ck["it"] + 1

    for it in range(it0, cfg.iters):
        t0 = time.time()
        net.eval()
        mine = []
        for _ in range(cfg.games_per_proc):
            mine += play_one(net, cfg, device)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        for part in gathered:
            window += part
        window = window[-cfg.window:]

        ds = Window(window)
        sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=cfg.seed, drop_last=True)
        loader = DataLoader(ds, batch_size=cfg.batch, sampler=sampler, num_workers=2,
                            pin_memory=True, drop_last=True)
        ddp.train()
        stats = torch.zeros(3, device=device)
        for ep in range(cfg.epochs):
            sampler.set_epoch(it * cfg.epochs + ep)
            for s, p, z in loader:
                s, p, z = s.to(device, non_blocking=True), p.to(device, non_blocking=True), z.to(device)
                logits, v = ddp(s)
                lp = -(p * F.log_softmax(logits, 1)).sum(1).mean()
                lv = F.mse_loss(v, z)
                opt.zero_grad()
                (lp + lv).backward()
                opt.step()
                stats += torch.stack([lp.detach(), lv.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        if rank == 0:
            n = max(stats[2].item(), 1)
            print(f"iter {it:4d} window {len(window):7d} lp {stats[0].item() / n:.4f} "
                  f"lv {stats[1].item() / n:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "it": it}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--games-per-proc", type=int, default=24)
    ap.add_argument("--sims", type=int, default=80)
    ap.add_argument("--explore-plies", type=int, default=8)
    ap.add_argument("--window", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default="runs/othello6")
    cfg = ap.parse_args()
    os.makedirs(cfg.out, exist_ok=True)
    mp.spawn(worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)


if __name__ == "__main__":
    main()
