"""Game of the Amazons (OpenSpiel, 6x6) -- self-play training with a snapshot league.

Training is the usual AlphaZero loop on every rank.  Every --eval-every
iterations the current net is frozen into the league and plays a round robin
of greedy-policy matches against the last --league-size snapshots; the
matches are split over ranks and the Elo table is kept by rank 0.

    torchrun --nproc_per_node=8 amazons_league.py --out /shared/amazons/r1
"""
import argparse
import glob
import json
import math
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

GAME = pyspiel.load_game("amazons")
OBS = GAME.observation_tensor_shape()
NA = GAME.num_distinct_actions()


class AmazonsNet(nn.Module):
    def __init__(self, ch=96, depth=6):
        super().__init__()
        layers = [nn.Conv2d(OBS[0], ch, 3, padding=1), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Conv2d(ch, ch, 3, padding=1), nn.GroupNorm(8, ch), nn.ReLU()]
        self.trunk = nn.Sequential(*layers)
        self.p = nn.Sequential(nn.Conv2d(ch, 2, 1), nn.Flatten(), nn.Linear(2 * OBS[1] * OBS[2], NA))
        self.v = nn.Sequential(nn.Conv2d(ch, 1, 1), nn.Flatten(), nn.Linear(OBS[1] * OBS[2], 64), nn.ReLU(),
                               nn.Linear(64, 1), nn.Tanh())

    def forward(self, x):
        h = self.trunk(x)
        return self.p(h), self.v(h).squeeze(1)


def obs_tensor(state, device):
    p = state.current_player()
    return torch.tensor(state.observation_tensor(p), dtype=torch.float32, device=device).view(1, *OBS)


@torch.no_grad()
def expand(net, state, device):
    logits, v = net(obs_tensor(state, device))
    legal = state.legal_actions()
    return legal, torch.softmax(logits[0, legal], 0).cpu().numpy(), float(v)


def mcts(net, root, sims, device, c=1.5, noise=True):
    # nodes: key=history tuple -> [player, legal, P, N, W]
    legal, P, _ = expand(net, root, device)
    if noise:
        P = 0.75 * P + 0.25 * np.random.dirichlet([0.3] * len(legal))
    tree = {(): [root.current_player(), legal, P, np.zeros(len(legal)), np.zeros(len(legal))]}
    for _ in range(sims):
        key, st, path = (), root.clone(), []
        while True:
            pl, lg, Pr, Nn, W = tree[key]
            q = np.divide(W, Nn, out=np.zeros(len(Nn)), where=Nn > 0)
            i = int(np.argmax(q + c * Pr * math.sqrt(Nn.sum() + 1) / (1 + Nn)))
            path.append((key, i))
            st.apply_action(lg[i])
            key = key + (lg[i],)
            if st.is_terminal():
                ret = st.returns()
                break
            if key not in tree:
                l2, p2, v = expand(net, st, device)
                tree[key] = [st.current_player(), l2, p2, np.zeros(len(l2)), np.zeros(len(l2))]
                me = st.current_player()
                ret = [v if q_ == me else -v for q_ in range(2)]
                break
        for k, i in path:
            tree[k][3][i] += 1
            tree[k][4][i] += ret[tree[k][0]]
    _, lg, _, Nn, _ = tree[()]
    return lg, Nn


def self_play_game(net, sims, device, temp_moves=9):
    st, rec, n = GAME.new_initial_state(), [], 0
    while not st.is_terminal():
        lg, Nn = mcts(net, st, sims, device)
        pi = np.zeros(NA, np.float32)
        pi[lg] = Nn / Nn.sum()
        rec.append((obs_tensor(st, "cpu")[0].numpy(), pi, st.current_player()))
        a = lg[np.random.choice(len(lg), p=Nn / Nn.sum())] if n < temp_moves else lg[int(Nn.argmax())]
        st.apply_action(a)
        n += 1
    r = st.returns()
    return [(o, pi, r[p]) for o, pi, p in rec]


@torch.no_grad()
def greedy_match(net_a, net_b, a_first, device):
    st = GAME.new_initial_state()
    seat = {0: net_a, 1: net_b} if a_first else {0: net_b, 1: net_a}
    while not st.is_terminal():
        logits, _ = seat[st.current_player()](obs_tensor(st, device))
        legal = st.legal_actions()
        st.apply_action(legal[int(logits[0, legal].argmax())])
    r = st.returns()[0 if a_first else 1]
    return 1.0 if r > 0 else 0.0


def league_round(net, out_dir, it, league_size, games_per_pair, rank, world):
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    league_dir = os.path.join(out_dir, "league")
    if rank == 0:
        torch.save({"model": net.state_dict(), "it": it}, os.path.join(league_dir, f"snap_{it:05d}.pt"))
    dist.barrier()
    snaps = sorted(glob.glob(os.path.join(league_dir, "snap_*.pt")))[-league_size:]
    players = {}
    for s in snaps:
        m = AmazonsNet()
        m.load_state_dict(torch.load(s, map_location="cpu")["model"])
        players[os.path.basename(s)[:-3]] = m.to(device).eval()
    names = sorted(players)
    fixtures = [(a, b, g % 2 == 0) for i, a in enumerate(names) for b in names[i + 1:] for g in range(games_per_pair)]
    results = [(a, b, greedy_match(players[a], players[b], first, device))
               for a, b, first in fixtures[rank::world]]
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        elo_path = os.path.join(league_dir, "elo.json")
        elo = json.load(open(elo_path)) if os.path.exists(elo_path) else {}
        for part in gathered:
            for a, b, s in part:
                ra, rb = elo.setdefault(a, 1200.0), elo.setdefault(b, 1200.0)
                ea = 1 / (1 + 10 ** ((rb - ra) / 400))
                elo[a], elo[b] = ra + 8 * (s - ea), rb - 8 * (s - ea)
        json.dump(elo, open(elo_path, "w"), indent=1)
        top = sorted(elo.items(), key=lambda kv: -kv[1])[:5]
        print("  elo top5: " + ", ".join(f"{k}={v:.0f}" for k, v in top), flush=True)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--games", type=int, default=12)
    ap.add_argument("--sims", type=int, default=96)
    ap.add_argument("--buffer", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--league-size", type=int, default=10)
    ap.add_argument("--games-per-pair", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(3)
    if rank == 0:
        os.makedirs(os.path.join(args.out, "league"), exist_ok=True)
    dist.barrier()

    net = AmazonsNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    buf = []

    for it in range(args.iters):
        t0 = time.time()
        net.eval()
        for _ in range(args.games):
            buf += self_play_game(net, args.sims, device)
        buf = buf[-args.buffer:]

        model.train()
        lsum = torch.zeros(2, device=device)
        for _ in range(args.steps):
            b = random.choices(buf, k=args.bs)
            x = torch.from_numpy(np.stack([e[0] for e in b])).to(device)
            pi = torch.from_numpy(np.stack([e[1] for e in b])).to(device)
            z = torch.tensor([e[2] for e in b], dtype=torch.float32, device=device)
            logits, v = model(x)
            lp = -(pi * F.log_softmax(logits, 1)).sum(1).mean()
            lv = F.mse_loss(v, z)
            opt.zero_grad(set_to_none=True)
            (lp + lv).backward()
            opt.step()
            lsum += torch.stack([lp.detach(), lv.detach()])
        dist.all_reduce(lsum)
        lsum /= world * args.steps
        if rank == 0:
            print(f"it {it} lp {lsum[0]:.3f} lv {lsum[1]:.3f} buf {len(buf)} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "it": it},
                       os.path.join(args.out, "last.pt"))
        if it % args.eval_every == 0:
            league_round(net, args.out, it, args.league_size, args.games_per_pair, rank, world)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
