#!/usr/bin/env python
# 9x9 Go learner.
#
# Self-play actors (selfplay/actor.py, running on the CPU fleet) write finished
# games as compressed npz shards into <run>/games/.  This learner repeatedly
# takes the most recent window of shards, trains one generation on them and
# exports the new network to <run>/models/ where the actors pick it up.
#
#   torchrun --nnodes=1 --nproc_per_node=8 go9_learner.py --run /shared/go9/run3
import argparse
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

BOARD = 9
N_ACTIONS = BOARD * BOARD + 1
IN_PLANES = 17  # 8 history planes per side + colour to move


class ShardWindow(Dataset):
    """All positions of a list of npz shards, held in host memory."""

    def __init__(self, files):
        states, pis, zs = [], [], []
        for f in files:
            with np.load(f) as d:
                states.append(d["states"])
                pis.append(d["pi"])
                zs.append(d["z"])
        self.states = np.concatenate(states)
        self.pi = np.concatenate(pis).astype(np.float32)
        self.z = np.concatenate(zs).astype(np.float32)

    def __len__(self):
        return len(self.z)

    def __getitem__(self, i):
        s = np.unpackbits(self.states[i], axis=-1)[..., :BOARD].astype(np.float32)
        # random dihedral symmetry
        k, flip = torch.randint(4, ()).item(), torch.randint(2, ()).item()
        s = np.rot90(s, k, axes=(1, 2))
        pi_board = np.rot90(self.pi[i, :-1].reshape(BOARD, BOARD), k)
        if flip:
            s = s[:, :, ::-1]
            pi_board = pi_board[:, ::-1]
        pi = np.concatenate([pi_board.reshape(-1), self.pi[i, -1:]])
        return torch.from_numpy(s.copy()), torch.from_numpy(pi.copy()), torch.tensor(self.z[i])


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
            nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return F.relu(x + self.net(x))


class GoNet(nn.Module):
    def __init__(self, blocks=10, channels=128):
        super().__init__()
        self.inp = nn.Sequential(nn.Conv2d(IN_PLANES, channels, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(blocks)])
        self.policy = nn.Sequential(nn.Conv2d(channels, 2, 1, bias=False), nn.BatchNorm2d(2),
                                    nn.ReLU(inplace=True), nn.Flatten(),
                                    nn.Linear(2 * BOARD * BOARD, N_ACTIONS))
        self.value = nn.Sequential(nn.Conv2d(channels, 1, 1, bias=False), nn.BatchNorm2d(1),
                                   nn.ReLU(inplace=True), nn.Flatten(),
                                   nn.Linear(BOARD * BOARD, 256), nn.ReLU(inplace=True),
                                   nn.Linear(256, 1), nn.Tanh())

    def forward(self, x):
        h = self.blocks(self.inp(x))
        return self.policy(h), self.value(h).squeeze(-1)


def latest_generation(models_dir):
    gens = sorted(glob.glob(os.path.join(models_dir, "gen_*.pt")))
    if not gens:
        return None, -1
    last = gens[-1]
    return last, int(os.path.basename(last)[4:10])


def pick_window(games_dir, window_shards, min_shards):
    """Blocks until enough shards exist, returns the newest `window_shards` of them."""
    while True:
        files = sorted(glob.glob(os.path.join(games_dir, "*.npz")))
        if len(files) >= min_shards:
            return files[-window_shards:]
        time.sleep(30)


def export(net, models_dir, gen, meta):
    tmp = os.path.join(models_dir, f".gen_{gen:06d}.pt.tmp")
    torch.save({"state_dict": net.state_dict(), "meta": meta}, tmp)
    os.replace(tmp, os.path.join(models_dir, f"gen_{gen:06d}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--generations", type=int, default=500)
    ap.add_argument("--window-shards", type=int, default=400)
    ap.add_argument("--min-shards", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=3e-5)
    ap.add_argument("--value-weight", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    games_dir = os.path.join(args.run, "games")
    models_dir = os.path.join(args.run, "models")
    if rank == 0:
        os.makedirs(models_dir, exist_ok=True)
        with open(os.path.join(args.run, "learner_args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    dist.barrier()

    net = GoNet()
    last, gen = latest_generation(models_dir)
    if last is not None:
        net.load_state_dict(torch.load(last, map_location="cpu")["state_dict"])
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.wd, nesterov=True)
    writer = SummaryWriter(os.path.join(args.run, "tb")) if rank == 0 else None
    step = 0

    while gen + 1 < args.generations:
        gen += 1
        # all ranks must train on the same file list, actors keep adding shards
        files = [pick_window(games_dir, args.window_shards, args.min_shards) if rank == 0 else None]
        dist.broadcast_object_list(files, src=0)
        files = files[0]

        ds = ShardWindow(files)
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=False)
        model.train()
        t0 = time.time()
        acc = torch.zeros(4, device=device)
        for s, pi, z in loader:
            s = s.to(device, non_blocking=True)
            pi = pi.to(device, non_blocking=True)
            z = z.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, v = model(s)
            logits, v = logits.float(), v.float()
            p_loss = -(pi * F.log_softmax(logits, -1)).sum(-1).mean()
            v_loss = F.mse_loss(v, z)
            loss = p_loss + args.value_weight * v_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            with torch.no_grad():
                top1 = (logits.argmax(-1) == pi.argmax(-1)).float().mean()
            acc += torch.stack([p_loss.detach(), v_loss.detach(), top1, torch.ones((), device=device)])

        dist.all_reduce(acc)
        n = acc[3].item()
        if rank == 0:
            p_l, v_l, t1 = (acc[:3] / n).tolist()
            print(f"gen {gen:5d} | {len(ds)} pos from {len(files)} shards | p {p_l:.3f} v {v_l:.3f} "
                  f"top1 {t1:.3f} | {time.time() - t0:.0f}s", flush=True)
            writer.add_scalar("loss/policy", p_l, gen)
            writer.add_scalar("loss/value", v_l, gen)
            writer.add_scalar("acc/top1", t1, gen)
            writer.add_scalar("data/positions", len(ds), gen)
            export(net, models_dir, gen, {"step": step, "positions": len(ds)})
        dist.barrier()
        del loader, ds

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
