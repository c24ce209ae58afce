#!/usr/bin/env python3
"""Gomoku (9x9, five in a row) self-play with a checkpoint league and Elo.

* every rank plays self-play games; all positions are exchanged so each rank
  holds the same replay window; SGD is split over ranks with a sampler
* the net has an auxiliary "threat" head (predicts cells that complete a
  four) that is trained only every --aux-every steps
* every --league-every iterations the current net plays the league members;
  matches are spread over ranks, rank 0 keeps the Elo table

torchrun --nproc_per_node=8 gomoku_league.py --out /nfs/gomoku/exp7
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

B = 9


def five(board, r, c):
    p = board[r, c]
    for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
        n = 1
        for s in (1, -1):
            rr, cc = r + s * dr, c + s * dc
            while 0 <= rr < B and 0 <= cc < B and board[rr, cc] == p:
                n, rr, cc = n + 1, rr + s * dr, cc + s * dc
        if n >= 5:
            return True
    return False


def threat_map(board, player):
    """Cells where `player` would make five."""
    out = np.zeros((B, B), np.float32)
    for r, c in zip(*np.nonzero(board == 0)):
        board[r, c] = player
        out[r, c] = five(board, r, c)
        board[r, c] = 0
    return out


class Gomoku:
    def __init__(self):
        self.board = np.zeros((B, B), np.int8)
        self.turn, self.result, self.n = 1, None, 0

    def copy(self):
        g = Gomoku()
        g.board, g.turn, g.result, g.n = self.board.copy(), self.turn, self.result, self.n
        return g

    def legal(self):
        return np.flatnonzero(self.board.ravel() == 0)

    def play(self, a):
        r, c = divmod(int(a), B)
        self.board[r, c] = self.turn
        self.n += 1
        if five(self.board, r, c):
            self.result = self.turn
        elif self.n == B * B:
            self.result = 0
        self.turn = -self.turn

    def planes(self):
        return np.stack([self.board == self.turn, self.board == -self.turn]).astype(np.float32)


class GomokuNet(nn.Module):
    def __init__(self, ch=64, blocks=6):
        super().__init__()
        self.stem = nn.Conv2d(2, ch, 3, padding=1)
        self.body = nn.ModuleList(nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.GroupNorm(8, ch), nn.SiLU(),
                                                nn.Conv2d(ch, ch, 3, padding=1), nn.GroupNorm(8, ch))
                                  for _ in range(blocks))
        self.policy = nn.Conv2d(ch, 1, 1)
        self.value = nn.Sequential(nn.Linear(ch, 128), nn.SiLU(), nn.Linear(128, 1), nn.Tanh())
        self.threat = nn.Sequential(nn.Conv2d(ch, 32, 3, padding=1), nn.SiLU(), nn.Conv2d(32, 1, 1))

    def forward(self, x, with_aux=False):
        h = F.silu(self.stem(x))
        for blk in self.body:
            h = F.silu(h + blk(h))
        p, v = self.policy(h).flatten(1), self.value(h.mean((2, 3))).squeeze(1)
        if with_aux:
            return p, v, self.threat(h).flatten(1)
        return p, v


@torch.no_grad()
def prior_value(net, g, dev):
    p, v = net(torch.from_numpy(g.planes())[None].to(dev))
    legal = g.legal()
    return legal, torch.softmax(p[0, legal], 0).cpu().numpy(), v.item()


def puct(net, root, sims, dev, noise=True):
    legal, pri, _ = prior_value(net, root, dev)
    if noise:
        pri = 0.75 * pri + 0.25 * np.random.dirichlet([0.1] * len(legal))
    tree = {(): (legal, pri, np.zeros(len(legal)), np.zeros(len(legal)))}
    for _ in range(sims):
        key, g, path = (), root.copy(), []
        while key in tree and g.result is None:
            mv, P, Nn, W = tree[key]
            q = np.where(Nn > 0, W / np.maximum(Nn, 1), 0.0)
            i = int(np.argmax(q + 1.5 * P * math.sqrt(Nn.sum() + 1) / (1 + Nn)))
            path.append((key, i))
            g.play(mv[i])
            key = key + (int(mv[i]),)
        if g.result is not None:
            v = 0.0 if g.result == 0 else -1.0
        else:
            lg, pr, v = prior_value(net, g, dev)
            tree[key] = (lg, pr, np.zeros(len(lg)), np.zeros(len(lg)))
        for k, i in reversed(path):
            v = -v
            tree[k][2][i] += 1
            tree[k][3][i] += v
    mv, _, Nn, _ = tree[()]
    return mv, Nn


def self_play(net, cfg, dev):
    g, rec = Gomoku(), []
    while g.result is None:
        mv, Nn = puct(net, g, cfg.sims, dev)
        pi = np.zeros(B * B, np.float32)
        pi[mv] = Nn / Nn.sum()
        rec.append((g.planes(), pi, g.turn, threat_map(g.board, g.turn)))
        a = np.random.choice(mv, p=Nn / Nn.sum()) if g.n < cfg.temp_moves else mv[int(Nn.argmax())]
        g.play(a)
    return [(s, pi, 0.0 if g.result == 0 else float(g.result == t) * 2 - 1, th) for s, pi, t, th in rec]


def match(net_a, net_b, a_black, sims, dev):
    g = Gomoku()
    seat = {1: net_a, -1: net_b} if a_black else {1: net_b, -1: net_a}
    while g.result is None:
        mv, Nn = puct(seat[g.turn], g, sims, dev, noise=False)
        g.play(mv[int(Nn.argmax())])
    if g.result == 0:
        return 0.5
    return 1.0 if seat[g.result] is net_a else 0.0


def elo_update(ratings, a, b, score, k=16.0):
    ea = 1.0 / (1 + 10 ** ((ratings[b] - ratings[a]) / 400))
    ratings[a] += k * (score - ea)
    ratings[b] -= k * (score - ea)


def run_league(net, cfg, dev, rank, world, it):
    league_dir = os.path.join(cfg.out, "league")
    meta = [None]
    if rank == 0:
        rpath = os.path.join(league_dir, "ratings.json")
        ratings = json.load(open(rpath)) if os.path.exists(rpath) else {}
        members = sorted(ratings)[-cfg.league_size:]
        fixtures = [(m, j % 2 == 0) for m in members for j in range(cfg.games_per_member)]
        meta = [(ratings, fixtures)]
    dist.broadcast_object_list(meta, src=0)
    ratings, fixtures = meta[0]

    results, cache = [], {}
    for idx in range(rank, len(fixtures), world):
        name, black = fixtures[idx]
        if name not in cache:
            opp = GomokuNet().to(dev).eval()
            opp.load_state_dict(torch.load(os.path.join(league_dir, name + ".pt"), map_location=dev))
            cache[name] = opp
        results.append((name, match(net, cache[name], black, cfg.eval_sims, dev)))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)

    if rank == 0:
        me = f"it{it:05d}"
        ratings[me] = max(ratings.values(), default=1000.0)
        for part in gathered:
            for name, score in part:
                elo_update(ratings, me, name, score)
        torch.save(net.state_dict(), os.path.join(league_dir, me + ".pt"))
        with open(os.path.join(league_dir, "ratings.json.tmp"), "w") as f:
            json.dump(ratings, f, indent=1)
        os.replace(os.path.join(league_dir, "ratings.json.tmp"), os.path.join(league_dir, "ratings.json"))
        n = sum(len(p) for p in gathered)
        print(f"  league: {me} elo {ratings[me]:.0f} after {n} games", flush=True)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--games", type=int, default=8, help="self-play games per rank per iteration")
    ap.add_argument("--sims", type=int, default=120)
    ap.add_argument("--eval-sims", type=int, default=60)
    ap.add_argument("--temp-moves", type=int, default=6)
    ap.add_argument("--window", type=int, default=150_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--aux-every", type=int, default=4)
    ap.add_argument("--aux-weight", type=float, default=0.3)
    ap.add_argument("--league-every", type=int, default=10)
    ap.add_argument("--league-size", type=int, default=12)
    ap.add_argument("--games-per-member", type=int, default=4)
    cfg = ap.parse_args()

    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lr_)
    np.random.seed(rank + 17)
    random.seed(rank + 17)
    torch.manual_seed(17)
    if rank == 0:
        os.makedirs(os.path.join(cfg.out, "league"), exist_ok=True)
    dist.barrier()

    net = GomokuNet().to(dev)
    # the threat head only receives gradient on aux steps
    model = DDP(net, device_ids=[lr_], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    window, step = [], 0

    for it in range(cfg.iters):
        t0 = time.time()
        net.eval()
        mine = [x for _ in range(cfg.games) for x in self_play(net, cfg, dev)]
        parts = [None] * world
        dist.all_gather_object(parts, mine)
        window = (window + [x for p in parts for x in p])[-cfg.window:]

        ds = TensorDataset(*(torch.from_numpy(np.stack([w[i] for w in window])) for i in range(4)))
        sampler = DistributedSampler(ds, shuffle=True, seed=17, drop_last=True)
        sampler.set_epoch(it)
        loader = DataLoader(ds, batch_size=cfg.batch, sampler=sampler, drop_last=True)
        model.train()
        tot = torch.zeros(4, device=dev)
        for s, pi, z, th in loader:
            s, pi, z, th = s.to(dev), pi.to(dev), z.float().to(dev), th.to(dev).flatten(1)
            aux = step % cfg.aux_every == 0
            out = model(s, with_aux=aux)
            lp = -(pi * F.log_softmax(out[0], 1)).sum(1).mean()
            lv = F.mse_loss(out[1], z)
            loss = lp + lv
            if aux:
                la = F.binary_cross_entropy_with_logits(out[2], th)
                loss = loss + cfg.aux_weight * la
                tot[2] += la.detach()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            tot += torch.stack([lp.detach(), lv.detach(), torch.zeros((), device=dev), torch.ones((), device=dev)])
        dist.all_reduce(tot)
        if rank == 0:
            n = tot[3].item()
            print(f"it {it:4d} window {len(window)} lp {tot[0] / n:.3f} lv {tot[1] / n:.3f} "
                  f"aux {tot[2] * cfg.aux_every / n:.3f} {time.time() - t0:.0f}s", flush=True)
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "it": it, "step": step},
                       os.path.join(cfg.out, "last.pt"))
        if it % cfg.league_every == 0:
            net.eval()
            run_league(net, cfg, dev, rank, world, it)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
