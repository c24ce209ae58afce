#!/usr/bin/env python3
"""
Backgammon: distill rollout equities from the self-play archive into the
evaluation net (TD-Gammon style 198 inputs -> 5 outcome probabilities).

The archive is produced by the self-play workers (selfplay_bg.py): positions
from recent generations, each labelled by a truncated 2-ply rollout.  After
training, the net is benchmarked against pubeval with 1-ply play.

torchrun --nproc_per_node=4 bg_distill.py --archive /data/bg/archive_g14 --epochs 40
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from bgenv import Backgammon, encode_198, pubeval_move

OUTCOMES = ["win", "win_gammon", "win_bg", "lose_gammon", "lose_bg"]


class EquityNet(nn.Module):
    def __init__(self, hidden=256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(198, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden // 2), nn.ReLU(), nn.Linear(hidden // 2, 5))

    def forward(self, x):
        return self.net(x)  # logits of the 5 cumulative outcome probabilities

    @staticmethod
    def equity(logits):
        p = torch.sigmoid(logits)
        return p[..., 0] * 2 - 1 + p[..., 1] + p[..., 2] - p[..., 3] - p[..., 4]


def load_archive(path, val_frac):
    x = np.load(os.path.join(path, "features.npy"))
    y = np.load(os.path.join(path, "outcomes.npy")).astype(np.float32)
    game_id = np.load(os.path.join(path, "game_id.npy"))
    # hold out whole games (positions of one game are strongly correlated)
    val_mask = (game_id % int(round(1 / val_frac))) == 0
    return (TensorDataset(torch.from_numpy(x[~val_mask]), torch.from_numpy(y[~val_mask])),
            TensorDataset(torch.from_numpy(x[val_mask]), torch.from_numpy(y[val_mask])))


@torch.no_grad()
def pick_move(net, game, dice, device):
    cands = game.legal_afterstates(dice)
    if len(cands) == 1:
        return cands[0][0]
    feats = torch.from_numpy(np.stack([encode_198(s, perspective=game.turn) for _, s in cands])).to(device)
    eq = EquityNet.equity(net(feats))
    return cands[int(eq.argmax())][0]


def vs_pubeval(net, n_games, device, seed):
    rng = np.random.default_rng(seed)
    pts = 0.0
    for g in range(n_games):
        game = Backgammon(first=g % 2)
        while not game.over():
            dice = tuple(rng.integers(1, 7, size=2))
            mv = pick_move(net, game, dice, device) if game.turn == 0 else pubeval_move(game, dice)
            game.apply(mv)
        pts += game.points(0)
    return pts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--archive", required=True)
    ap.add_argument("--out", default="runs/bg_distill")
    ap.add_argument("--init", default=None)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-frac", type=float, default=0.02)
    ap.add_argument("--bench-games", type=int, default=2000, help="total over all ranks")
    ap.add_argument("--bench-every", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds = load_archive(args.archive, args.val_frac)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=8192,
                        sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)

    net = EquityNet().to(device)
    if args.init:
        net.load_state_dict(torch.load(args.init, map_location=device)["model"])
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=1e-5)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train / {len(val_ds)} val positions, {len(train_dl)} steps per epoch", flush=True)

    best_val = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach() * x.shape[0], torch.tensor(float(x.shape[0]), device=device)])

        model.eval()
        val = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                logits = net(x)
                val[0] += F.binary_cross_entropy_with_logits(logits, y, reduction="sum") / 5
                val[1] += (EquityNet.equity(logits) - EquityNet.equity(torch.logit(y.clamp(1e-6, 1 - 1e-6)))
                           ).abs().sum()
                val[2] += x.shape[0]
        dist.all_reduce(run)
        dist.all_reduce(val)
        tr_loss, val_loss, val_eq_err = (run[0] / run[1]).item(), (val[0] / val[2]).item(), (val[1] / val[2]).item()

        bench = ""
        if (epoch + 1) % args.bench_every == 0:
            pts = torch.tensor([vs_pubeval(net, args.bench_games // world, device, seed=epoch * 1000 + rank)],
                               device=device, dtype=torch.float64)
            dist.all_reduce(pts)
            bench = f" | vs pubeval {pts.item() / (args.bench_games // world * world):+.3f} ppg"

        if rank == 0:
            print(f"epoch {epoch:3d} | train {tr_loss:.5f} | val {val_loss:.5f} eq-err {val_eq_err:.4f}{bench} "
                  f"| {time.time() - t0:.0f}s", flush=True)
            state = {"model": net.state_dict(), "epoch": epoch, "val_loss": val_loss}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_loss < best_val:
                best_val = val_loss
                torch.save(state, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
