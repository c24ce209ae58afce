#!/usr/bin/env python
"""
Breakthrough 6x6 -- AlphaZero-style training, multi-GPU.

Self-play positions from all ranks are pooled every iteration (all ranks keep
the same global replay buffer), then every rank samples its minibatches from
that buffer.

Launch:
    torchrun --nproc_per_node 4 breakthrough_az.py --config configs/bt6.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

N = 6
DIRS = (-1, 0, 1)  # column deltas: diagonal-left, straight, diagonal-right
N_ACTIONS = N * N * 3


class Breakthrough:
    def __init__(self):
        self.b = np.zeros((N, N), np.int8)
        self.b[:2] = 1      # player 1 moves "up" (increasing row)
        self.b[-2:] = -1
        self.to_move = 1
        self.winner = 0
        self.ply = 0

    def clone(self):
        o = Breakthrough.__new__(Breakthrough)
        o.b, o.to_move, o.winner, o.ply = self.b.copy(), self.to_move, self.winner, self.ply
        return o

    def legal(self):
        p, out = self.to_move, []
        for r, c in zip(*np.nonzero(self.b == p)):
            rr = r + p
            if not 0 <= rr < N:
                continue
            for k, dc in enumerate(DIRS):
                cc = c + dc
                if not 0 <= cc < N:
                    continue
                t = self.b[rr, cc]
                if (dc == 0 and t == 0) or (dc != 0 and t != p):
                    out.append((r * N + c) * 3 + k)
        return out

    def play(self, a):
        sq, k = divmod(a, 3)
        r, c = divmod(sq, N)
        rr, cc = r + self.to_move, c + DIRS[k]
        self.b[r, c] = 0
        self.b[rr, cc] = self.to_move
        self.ply += 1
        if rr == (N - 1 if self.to_move == 1 else 0) or not (self.b == -self.to_move).any():
            self.winner = self.to_move
        self.to_move = -self.to_move

    def encode(self):
        b = self.b if self.to_move == 1 else -self.b[::-1]
        return np.stack([b == 1, b == -1]).astype(np.float32)

    def canon(self, a):
        if self.to_move == 1:
            return a
        sq, k = divmod(a, 3)
        r, c = divmod(sq, N)
        return ((N - 1 - r) * N + c) * 3 + k


class Net(nn.Module):
    def __init__(self, ch=128, blocks=6):
        super().__init__()
        self.inp = nn.Conv2d(2, ch, 3, padding=1)
        self.res = nn.ModuleList()
        for _ in range(blocks):
            self.res.append(nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU(),
                                          nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch)))
        self.pol = nn.Sequential(nn.Conv2d(ch, 3, 1), nn.Flatten())
        self.val = nn.Sequential(nn.Conv2d(ch, 1, 1), nn.Flatten(), nn.Linear(N * N, 64), nn.ReLU(),
                                 nn.Linear(64, 1), nn.Tanh())

    def forward(self, x):
        h = F.relu(self.inp(x))
        for blk in self.res:
            h = F.relu(h + blk(h))
        # policy planes are (direction, row, col) -> reorder to (row, col, direction)
        p = self.pol[0](h).permute(0, 2, 3, 1).reshape(x.shape[0], -1)
        return p, self.val(h).squeeze(-1)


class MCTS:
    def __init__(self, net, device, sims, cpuct=2.0):
        self.net, self.device, self.sims, self.cpuct = net, device, sims, cpuct

    @torch.no_grad()
    def _expand(self, st):
        logits, v = self.net(torch.from_numpy(st.encode())[None].to(self.device))
        moves = st.legal()
        idx = [st.canon(a) for a in moves]
        pri = torch.softmax(logits[0, idx], 0).cpu().numpy()
        return {"moves": moves, "P": pri, "N": np.zeros(len(moves)), "W": np.zeros(len(moves)), "kids": {}}, v.item()

    def run(self, root_state, noise=True):
        root, _ = self._expand(root_state)
        if noise:
            root["P"] = 0.75 * root["P"] + 0.25 * np.random.dirichlet([0.3] * len(root["moves"]))
        for _ in range(self.sims):
            node, st, path = root, root_state.clone(), []
            while True:
                Q = np.divide(node["W"], node["N"], out=np.zeros_like(node["W"]), where=node["N"] > 0)
                i = int(np.argmax(Q + self.cpuct * node["P"] * math.sqrt(node["N"].sum() + 1) / (1 + node["N"])))
                path.append((node, i))
                st.play(node["moves"][i])
                if st.winner:
                    v = -1.0
                    break
                if i not in node["kids"]:
                    node["kids"][i], v = self._expand(st)
                    break
                node = node["kids"][i]
            for nd, i in reversed(path):
                v = -v
                nd["N"][i] += 1
                nd["W"][i] += v
        return root["moves"], root["N"]


def self_play(mcts, temp_plies):
    st, hist = Breakthrough(), []
    while not st.winner:
        moves, visits = mcts.run(st)
        pi = np.zeros(N_ACTIONS, np.float32)
        for a, n in zip(moves, visits):
            pi[st.canon(a)] = n / visits.sum()
        hist.append((st.encode(), pi, st.to_move))
        j = np.random.choice(len(moves), p=visits / visits.sum()) if st.ply < temp_plies else int(visits.argmax())
        st.play(moves[j])
    return hist, st.winner


def collect(mcts, n_games, temp_plies, device):
    states, pis, zs = [], [], []
    for _ in range(n_games):
        hist, w = self_play(mcts, temp_plies)
        for s, pi, who in hist:
            states.append(s)
            pis.append(pi)
            zs.append(1.0 if w == who else -1.0)
    return (torch.from_numpy(np.stack(states)).to(device),
            torch.from_numpy(np.stack(pis)).to(device),
            torch.tensor(zs, device=device))


def share(local, world):
    out = []
    for t in local:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        out.append(torch.cat(parts))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bt6.yaml")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.get("seed", 0))
    np.random.seed(cfg.get("seed", 0) + 100 * rank)
    gen = torch.Generator(device=device).manual_seed(cfg.get("seed", 0) + rank)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(Net(cfg["channels"], cfg["blocks"])).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, weight_decay=cfg["wd"])
    mcts = MCTS(net, device, cfg["sims"])
    buf_s = buf_p = buf_z = None
    out_dir = cfg["out_dir"]
    os.makedirs(out_dir, exist_ok=True)

    for it in range(cfg["iterations"]):
        t0 = time.time()
        net.eval()
        s, p, z = collect(mcts, cfg["games_per_rank"], cfg["temp_plies"], device)
        s, p, z = share((s, p, z), world)
        if buf_s is None:
            buf_s, buf_p, buf_z = s, p, z
        else:
            buf_s = torch.cat([buf_s, s])[-cfg["buffer"]:]
            buf_p = torch.cat([buf_p, p])[-cfg["buffer"]:]
            buf_z = torch.cat([buf_z, z])[-cfg["buffer"]:]
        t_sp = time.time() - t0

        model.train()
        meter = torch.zeros(2, device=device)
        for _ in range(cfg["steps_per_iter"]):
            idx = torch.randint(0, buf_z.numel(), (cfg["batch_size"],), device=device, generator=gen)
            logits, v = model(buf_s[idx])
            lp = -(buf_p[idx] * F.log_softmax(logits, -1)).sum(-1).mean()
            lv = F.mse_loss(v, buf_z[idx])
            opt.zero_grad(set_to_none=True)
            (lp + lv).backward()
            opt.step()
            meter += torch.stack([lp.detach(), lv.detach()])
        dist.all_reduce(meter)
        meter /= world * cfg["steps_per_iter"]

        if rank == 0:
            print(f"iter {it:4d} | +{z.numel()} pos (buffer {buf_z.numel()}) | "
                  f"policy {meter[0]:.4f} value {meter[1]:.4f} | selfplay {t_sp:.0f}s "
                  f"total {time.time() - t0:.0f}s", flush=True)
            if (it + 1) % cfg["ckpt_every"] == 0:
                torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "iter": it, "cfg": cfg},
                           os.path.join(out_dir, f"bt6_{it + 1:05d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
