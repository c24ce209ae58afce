#!/usr/bin/env python3
"""AlphaGo-Zero style gated training for Kalah(6,4).

Loop:  best net generates self-play games  ->  candidate trains on them
       ->  candidate plays --eval-games against best  ->  promote if it scores
       at least --gate.
Self-play and evaluation games are split over all GPUs.

    torchrun --nproc_per_node=8 kalah_gated.py --eval-games 400 --gate 0.55
"""
import argparse
import copy
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
from torch.utils.tensorboard import SummaryWriter

PITS, SEEDS = 6, 4


class Kalah:
    # board[0:6] player 0 pits, board[6] player 0 store, board[7:13] player 1 pits, board[13] store
    def __init__(self):
        self.board = [SEEDS] * PITS + [0] + [SEEDS] * PITS + [0]
        self.player = 0
        self.over = False

    def clone(self):
        k = Kalah.__new__(Kalah)
        k.board, k.player, k.over = self.board[:], self.player, self.over
        return k

    def legal(self):
        off = 0 if self.player == 0 else PITS + 1
        return [i for i in range(PITS) if self.board[off + i] > 0]

    def play(self, a):
        off = 0 if self.player == 0 else PITS + 1
        my_store, opp_store = (PITS, 2 * PITS + 1) if self.player == 0 else (2 * PITS + 1, PITS)
        pos = off + a
        seeds, self.board[pos] = self.board[pos], 0
        while seeds:
            pos = (pos + 1) % 14
            if pos == opp_store:
                continue
            self.board[pos] += 1
            seeds -= 1
        if pos != my_store and off <= pos < off + PITS and self.board[pos] == 1:
            opposite = 2 * PITS - pos
            if self.board[opposite]:
                self.board[my_store] += self.board[opposite] + 1
                self.board[opposite] = self.board[pos] = 0
        if sum(self.board[0:PITS]) == 0 or sum(self.board[PITS + 1:2 * PITS + 1]) == 0:
            self.board[PITS] += sum(self.board[0:PITS])
            self.board[2 * PITS + 1] += sum(self.board[PITS + 1:2 * PITS + 1])
            for i in list(range(PITS)) + list(range(PITS + 1, 2 * PITS + 1)):
                self.board[i] = 0
            self.over = True
        elif pos != my_store:
            self.player = 1 - self.player

    def score(self, p):
        d = self.board[PITS] - self.board[2 * PITS + 1]
        return float(np.sign(d if p == 0 else -d))

    def features(self):
        b = self.board if self.player == 0 else self.board[PITS + 1:] + self.board[:PITS + 1]
        return np.asarray(b, dtype=np.float32) / (2 * PITS * SEEDS)


class KalahNet(nn.Module):
    def __init__(self, hidden=256, layers=4):
        super().__init__()
        mods, d = [], 14
        for _ in range(layers):
            mods += [nn.Linear(d, hidden), nn.LayerNorm(hidden), nn.GELU()]
            d = hidden
        self.body = nn.Sequential(*mods)
        self.pi = nn.Linear(hidden, PITS)
        self.v = nn.Sequential(nn.Linear(hidden, 1), nn.Tanh())

    def forward(self, x):
        h = self.body(x)
        return self.pi(h), self.v(h).squeeze(-1)


class Tree:
    def __init__(self, net, device, c_puct=1.0):
        self.net, self.device, self.c = net, device, c_puct

    @torch.no_grad()
    def _eval(self, st):
        logits, v = self.net(torch.from_numpy(st.features())[None].to(self.device))
        legal = st.legal()
        p = torch.softmax(logits[0, legal], 0).cpu().numpy()
        return {"player": st.player, "moves": legal, "P": p, "N": np.zeros(len(legal)),
                "W": np.zeros(len(legal)), "kids": {}}, v.item()

    def search(self, root_st, sims, noise):
        root, _ = self._eval(root_st)
        if noise:
            root["P"] = 0.75 * root["P"] + 0.25 * np.random.dirichlet([0.5] * len(root["moves"]))
        for _ in range(sims):
            node, st, path = root, root_st.clone(), []
            while True:
                q = np.divide(node["W"], node["N"], out=np.zeros(len(node["N"])), where=node["N"] > 0)
                i = int(np.argmax(q + self.c * node["P"] * math.sqrt(node["N"].sum() + 1) / (1 + node["N"])))
                path.append((node, i))
                st.play(node["moves"][i])
                if st.over:
                    leaf_player, v = 0, st.score(0)
                    break
                if i not in node["kids"]:
                    node["kids"][i], v = self._eval(st)
                    leaf_player = st.player
                    break
                node = node["kids"][i]
            for nd, i in reversed(path):
                nd["N"][i] += 1
                nd["W"][i] += v if nd["player"] == leaf_player else -v
        return root["moves"], root["N"]


def gen_selfplay(tree, n_games, sims):
    data = []
    for _ in range(n_games):
        st, hist, t = Kalah(), [], 0
        while not st.over:
            moves, n = tree.search(st, sims, noise=True)
            pi = np.zeros(PITS, np.float32)
            pi[moves] = n / n.sum()
            hist.append((st.features(), pi, st.player))
            j = np.random.choice(len(moves), p=n / n.sum()) if t < 12 else int(n.argmax())
            st.play(moves[j])
            t += 1
        data += [(f, pi, st.score(p)) for f, pi, p in hist]
    return data


def arena(cand_tree, best_tree, n_games, sims, first_offset):
    score = 0.0
    for g in range(n_games):
        st = Kalah()
        cand_seat = (g + first_offset) % 2
        while not st.over:
            tree = cand_tree if st.player == cand_seat else best_tree
            moves, n = tree.search(st, sims, noise=False)
            st.play(moves[int(n.argmax())])
        s = st.score(cand_seat)
        score += 1.0 if s > 0 else (0.5 if s == 0 else 0.0)
    return score


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--generations", type=int, default=100)
    ap.add_argument("--selfplay-games", type=int, default=2048, help="total over all ranks")
    ap.add_argument("--eval-games", type=int, default=400, help="total over all ranks")
    ap.add_argument("--sims", type=int, default=100)
    ap.add_argument("--eval-sims", type=int, default=100)
    ap.add_argument("--gate", type=float, default=0.55)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--window-gens", type=int, default=4)
    ap.add_argument("--out", default="runs/kalah")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(0)
    writer = SummaryWriter(args.out) if rank == 0 else None

    best = KalahNet().to(dev).eval()
    cand = copy.deepcopy(best)
    model = DDP(cand, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    windows, best_gen = [], 0

    for gen in range(args.generations):
        t0 = time.time()
        windows.append(gen_selfplay(Tree(best, dev), args.selfplay_games // world, args.sims))
        windows = windows[-args.window_gens:]
        data = [x for w in windows for x in w]
        feats = torch.tensor(np.stack([d[0] for d in data]), device=dev)
        pis = torch.tensor(np.stack([d[1] for d in data]), device=dev)
        zs = torch.tensor([d[2] for d in data], dtype=torch.float32, device=dev)

        model.train()
        for step in range(args.steps):
            idx = torch.randint(len(zs), (args.batch,), device=dev)
            logits, v = model(feats[idx])
            loss_p = -(pis[idx] * F.log_softmax(logits, -1)).sum(-1).mean()
            loss_v = F.mse_loss(v, zs[idx])
            opt.zero_grad(set_to_none=True)
            (loss_p + loss_v).backward()
            opt.step()
        cand.eval()

        won = arena(Tree(cand, dev), Tree(best, dev), args.eval_games // world, args.eval_sims, rank)
        win_rate = won / (args.eval_games // world)
        promote = torch.tensor([1 if win_rate >= args.gate else 0], device=dev)
        dist.broadcast(promote, src=0)
        if promote.item():
            best.load_state_dict(cand.state_dict())
            best_gen = gen

        if rank == 0:
            print(f"gen {gen:3d} | pos {len(zs)} | loss p {loss_p.item():.3f} v {loss_v.item():.3f} | "
                  f"win rate {win_rate:.3f} {'PROMOTED' if promote.item() else ''} | "
                  f"{time.time() - t0:.0f}s", flush=True)
            writer.add_scalar("eval/win_rate_vs_best", win_rate, gen)
            writer.add_scalar("eval/best_generation", best_gen, gen)
            writer.add_scalar("train/policy_loss", loss_p.item(), gen)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"best": best.state_dict(), "candidate": cand.state_dict(), "opt": opt.state_dict(),
                        "gen": gen, "best_gen": best_gen}, os.path.join(args.out, "state.pt"))
            if promote.item():
                torch.save(best.state_dict(), os.path.join(args.out, f"best_gen{gen:03d}.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
