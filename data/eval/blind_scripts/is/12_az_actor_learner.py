#!/usr/bin/env python3
"""Actor / learner AlphaZero driver.

Learner (GPUs, DDP):
    torchrun --nproc_per_node=8 az_actor_learner.py learner --game ultimate_ttt --root /shared/az/uttt
Actors (CPU boxes, as many as you like):
    python az_actor_learner.py actor --game ultimate_ttt --root /shared/az/uttt --games 50

Both sides only meet through the shared root:
    root/models/latest.pt     published by the learner every --publish-every steps
    root/replay/*.npz         written by actors, one file per batch of games
"""
import argparse
import glob
import os
import random
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from azero.games import make_game
from azero.mcts import MCTS


class AZNet(nn.Module):
    def __init__(self, in_planes, board_hw, n_actions, ch=128, blocks=8):
        super().__init__()
        h, w = board_hw
        self.stem = nn.Sequential(nn.Conv2d(in_planes, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        blks = []
        for _ in range(blocks):
            blks.append(nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(),
                                      nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)))
        self.blocks = nn.ModuleList(blks)
        self.policy = nn.Sequential(nn.Conv2d(ch, 4, 1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * h * w, n_actions))
        self.value = nn.Sequential(nn.Conv2d(ch, 2, 1), nn.ReLU(), nn.Flatten(), nn.Linear(2 * h * w, 128),
                                   nn.ReLU(), nn.Linear(128, 1), nn.Tanh())

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = F.relu(x + b(x))
        return self.policy(x), self.value(x).squeeze(-1)


def build_net(game):
    return AZNet(game.num_planes, game.board_shape, game.num_actions)


# ----------------------------------------------------------------------------- actor
def actor(args):
    game = make_game(args.game)
    net = build_net(game).eval()
    latest = os.path.join(args.root, "models", "latest.pt")
    os.makedirs(os.path.join(args.root, "replay"), exist_ok=True)
    torch.set_num_threads(1)
    version = -1
    while True:
        while not os.path.exists(latest):
            time.sleep(10)
        ck = torch.load(latest, map_location="cpu")
        if ck["version"] != version:
            net.load_state_dict(ck["model"])
            version = ck["version"]
        mcts = MCTS(lambda x: net(torch.from_numpy(x)), game, sims=args.sims, c_puct=args.c_puct)
        S, P, Z = [], [], []
        for _ in range(args.games):
            states, pis, players, winner = mcts.self_play(temperature_moves=args.temp_moves)
            S += states
            P += pis
            Z += [0.0 if winner == 0 else (1.0 if p == winner else -1.0) for p in players]
        name = f"{version:06d}_{socket.gethostname()}_{uuid.uuid4().hex[:8]}.npz"
        tmp = os.path.join(args.root, "replay", "." + name)
        np.savez_compressed(tmp, s=np.stack(S).astype(np.uint8), pi=np.stack(P).astype(np.float16),
                            z=np.array(Z, np.int8))
        os.replace(tmp, os.path.join(args.root, "replay", name))
        print(f"[actor] model v{version}: wrote {len(Z)} positions", flush=True)


# ----------------------------------------------------------------------------- learner
def load_replay(files):
    s, p, z = [], [], []
    for f in files:
        with np.load(f) as d:
            s.append(d["s"])
            p.append(d["pi"])
            z.append(d["z"])
    return (torch.from_numpy(np.concatenate(s)).float(), torch.from_numpy(np.concatenate(p)).float(),
            torch.from_numpy(np.concatenate(z)).float())


def publish(model, step, version, root):
    path = os.path.join(root, "models", "latest.pt")
    torch.save({"model": model.state_dict(), "step": step, "version": version}, path + ".tmp")
    os.replace(path + ".tmp", path)
    torch.save({"model": model.state_dict(), "step": step, "version": version},
               os.path.join(root, "models", f"v{version:05d}.pt"))


def learner(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    game = make_game(args.game)

    net = build_net(game)
    step, version = 0, 0
    latest = os.path.join(args.root, "models", "latest.pt")
    if os.path.exists(latest):
        ck = torch.load(latest, map_location="cpu")
        net.load_state_dict(ck["model"])
        step, version = ck["step"], ck["version"]
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    if rank == 0:
        os.makedirs(os.path.join(args.root, "models"), exist_ok=True)
        if version == 0:
            publish(model, step, version, args.root)
    dist.barrier()

    while step < args.total_steps:
        # rank 0 decides when there is enough fresh data and which files to use
        meta = [None]
        if rank == 0:
            while len(glob.glob(os.path.join(args.root, "replay", f"{version:06d}_*.npz"))) < args.min_new_files:
                time.sleep(15)
            meta = [sorted(glob.glob(os.path.join(args.root, "replay", "*.npz")),
                           key=os.path.getmtime)[-args.window_files:]]
        dist.broadcast_object_list(meta, src=0)
        files = meta[0]
        ds = TensorDataset(*load_replay(files))
        sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
        sampler.set_epoch(version)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=True)

        model.train()
        acc = torch.zeros(3, device=device)
        for i, (x, pi, zz) in enumerate(loader):
            if i >= args.publish_every:
                break
            x, pi, zz = x.to(device, non_blocking=True), pi.to(device, non_blocking=True), zz.to(device)
            logits, v = model(x)
            lp = -(pi * F.log_softmax(logits, -1)).sum(-1).mean()
            lv = F.mse_loss(v, zz)
            opt.zero_grad(set_to_none=True)
            (lp + lv).backward()
            opt.step()
            step += 1
            acc += torch.stack([lp.detach(), lv.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        version += 1
        if rank == 0:
            n = acc[2].clamp(min=1)
            print(f"[learner] v{version} step {step} | {len(ds)} pos from {len(files)} files | "
                  f"lp {(acc[0] / n).item():.3f} lv {(acc[1] / n).item():.3f}", flush=True)
            publish(model, step, version, args.root)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["actor", "learner"])
    ap.add_argument("--game", default="ultimate_ttt")
    ap.add_argument("--root", required=True)
    ap.add_argument("--sims", type=int, default=200)
    ap.add_argument("--c-puct", type=float, default=1.5)
    ap.add_argument("--temp-moves", type=int, default=12)
    ap.add_argument("--games", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--publish-every", type=int, default=500)
    ap.add_argument("--min-new-files", type=int, default=16)
    ap.add_argument("--window-files", type=int, default=256)
    ap.add_argument("--total-steps", type=int, default=500_000)
    args = ap.parse_args()
    random.seed()
    (actor if args.role == "actor" else learner)(args)


if __name__ == "__main__":
    main()
