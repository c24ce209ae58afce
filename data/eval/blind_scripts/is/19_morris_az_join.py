#!/usr/bin/env python
"""Nine Men's Morris (OpenSpiel) AlphaZero, one self-play/learner process per GPU.

Each rank keeps the positions of its own games only and makes one pass over
them per iteration.  Games differ in length, so ranks end up with different
numbers of batches; DDP's join() shadows the collectives of ranks that run
out early.

    torchrun --nproc_per_node=8 morris_az.py --wandb-project morris-az
"""
import argparse
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
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

GAME = pyspiel.load_game("nine_mens_morris")
OBS_DIM = GAME.observation_tensor_size()
NA = GAME.num_distinct_actions()


class MorrisNet(nn.Module):
    def __init__(self, width=512, blocks=4):
        super().__init__()
        self.inp = nn.Linear(OBS_DIM, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                                  nn.Linear(width, width)) for _ in range(blocks))
        self.out_norm = nn.LayerNorm(width)
        self.pi = nn.Linear(width, NA)
        self.v = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        h = F.gelu(self.out_norm(h))
        return self.pi(h), torch.tanh(self.v(h)).squeeze(-1)


class Searcher:
    def __init__(self, net, device, sims, c_puct=1.25):
        self.net, self.device, self.sims, self.c = net, device, sims, c_puct

    @torch.no_grad()
    def _leaf(self, st):
        pl = st.current_player()
        x = torch.tensor(st.observation_tensor(pl), dtype=torch.float32, device=self.device)[None]
        logits, v = self.net(x)
        legal = st.legal_actions()
        return [pl, legal, torch.softmax(logits[0, legal], 0).cpu().numpy(),
                np.zeros(len(legal)), np.zeros(len(legal)), {}], v.item()

    def run(self, root_state, noise=True):
        root, _ = self._leaf(root_state)
        if noise:
            root[2] = 0.75 * root[2] + 0.25 * np.random.dirichlet([0.3] * len(root[1]))
        for _ in range(self.sims):
            node, st, path = root, root_state.clone(), []
            while True:
                pl, legal, P, N, W, kids = node
                q = np.divide(W, N, out=np.zeros(len(N)), where=N > 0)
                i = int(np.argmax(q + self.c * P * math.sqrt(N.sum() + 1) / (1 + N)))
                path.append((node, i))
                st.apply_action(legal[i])
                if st.is_terminal():
                    ret = st.returns()
                    break
                if i not in kids:
                    kids[i], v = self._leaf(st)
                    me = st.current_player()
                    ret = [v if p == me else -v for p in range(2)]
                    break
                node = kids[i]
            for nd, i in path:
                nd[3][i] += 1
                nd[4][i] += ret[nd[0]]
        return root[1], root[3]


def play(searcher, temp_plies, max_plies=300):
    st, rec = GAME.new_initial_state(), []
    while not st.is_terminal() and len(rec) < max_plies:
        legal, N = searcher.run(st)
        pi = np.zeros(NA, np.float32)
        pi[legal] = N / N.sum()
        pl = st.current_player()
        rec.append((np.asarray(st.observation_tensor(pl), np.float32), pi, pl))
        k = np.random.choice(len(legal), p=N / N.sum()) if len(rec) <= temp_plies else int(N.argmax())
        st.apply_action(legal[k])
    ret = st.returns() if st.is_terminal() else [0.0, 0.0]
    return [(o, pi, ret[pl]) for o, pi, pl in rec]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--games", type=int, default=16)
    ap.add_argument("--sims", type=int, default=128)
    ap.add_argument("--temp-plies", type=int, default=20)
    ap.add_argument("--keep", type=int, default=6, help="iterations of own games kept per rank")
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--out", default="/shared/morris/az1")
    ap.add_argument("--wandb-project", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(7 + rank)
    random.seed(7 + rank)
    torch.manual_seed(7)
    use_wandb = args.wandb_project is not None and rank == 0
    if use_wandb:
        wandb.init(project=args.wandb_project, config={**vars(args), "world_size": world})

    net = MorrisNet().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    it0 = 0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["net"])
        opt.load_state_dict(ck["opt"])
        it0 = ck["it"] + 1
    model = DDP(net, device_ids=[local_rank])
    searcher = Searcher(net, device, args.sims)
    chunks = []
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for it in range(it0, args.iters):
        t0 = time.time()
        net.eval()
        chunks.append([p for _ in range(args.games) for p in play(searcher, args.temp_plies)])
        chunks = chunks[-args.keep:]
        data = [p for c in chunks for p in c]
        ds = TensorDataset(torch.from_numpy(np.stack([d[0] for d in data])),
                           torch.from_numpy(np.stack([d[1] for d in data])),
                           torch.tensor([d[2] for d in data], dtype=torch.float32))
        loader = DataLoader(ds, batch_size=args.bs, shuffle=True, drop_last=True)
        t_play = time.time() - t0

        model.train()
        acc = torch.zeros(3, device=device)
        with model.join():
            for x, pi, z in loader:
                x, pi, z = x.to(device), pi.to(device), z.to(device)
                logits, v = model(x)
                lp = -(pi * F.log_softmax(logits, -1)).sum(-1).mean()
                lv = F.mse_loss(v, z)
                opt.zero_grad(set_to_none=True)
                (lp + lv).backward()
                opt.step()
                acc += torch.stack([lp.detach(), lv.detach(), torch.ones((), device=device)])
        # outside join(): every rank is back in step
        counts = torch.tensor([len(ds), acc[2].item()], device=device)
        dist.all_reduce(acc)
        dist.all_reduce(counts)

        if rank == 0:
            n = acc[2].clamp(min=1)
            stats = {"loss/policy": (acc[0] / n).item(), "loss/value": (acc[1] / n).item(),
                     "data/positions": counts[0].item(), "data/steps": counts[1].item(),
                     "time/selfplay": t_play, "time/iter": time.time() - t0}
            print(f"it {it} " + " ".join(f"{k}={v:.4g}" for k, v in stats.items()), flush=True)
            if use_wandb:
                wandb.log(stats, step=it)
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "it": it}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if use_wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
