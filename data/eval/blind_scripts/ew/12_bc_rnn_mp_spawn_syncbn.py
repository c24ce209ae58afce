"""BC-RNN (robomimic-style) on a multi-human low-dim dataset, one process per GPU via mp.spawn.

Start it with plain python; it spawns one worker per GPU itself:

    python 12_bc_rnn_mp_spawn_syncbn.py --dataset datasets/square/mh/low_dim_v141.hdf5 --gpus 4
"""
import argparse
import os
import socket
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

OBS_KEYS = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--out", default="runs/bc_rnn_square_mh")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--seq_len", type=int, default=10)
    ap.add_argument("--batch_size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4, help="lr for one GPU; scaled by --gpus")
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--val_frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def load_split_and_stats(path, val_frac, seed):
    """Runs once in the parent (CPU only); the workers receive the result."""
    with h5py.File(path, "r") as f:
        demos = sorted(f["data"].keys(), key=lambda d: int(d.split("_")[-1]))
        obs = np.concatenate([np.concatenate([f[f"data/{d}/obs/{k}"][()] for k in OBS_KEYS], -1) for d in demos])
    perm = np.random.RandomState(seed).permutation(len(demos))
    n_val = max(1, int(round(val_frac * len(demos))))
    split = {"val": [demos[i] for i in perm[:n_val]], "train": [demos[i] for i in perm[n_val:]]}
    stats = {"mean": obs.mean(0).astype(np.float32), "std": (obs.std(0) + 1e-3).astype(np.float32)}
    return split, stats


class SeqDataset(Dataset):
    def __init__(self, path, demos, seq_len, stats):
        self.seq_len, self.obs, self.act, self.idx = seq_len, [], [], []
        with h5py.File(path, "r") as f:
            for i, d in enumerate(demos):
                o = np.concatenate([f[f"data/{d}/obs/{k}"][()] for k in OBS_KEYS], -1).astype(np.float32)
                self.obs.append((o - stats["mean"]) / stats["std"])
                self.act.append(f[f"data/{d}/actions"][()].astype(np.float32))
                self.idx += [(i, t) for t in range(len(o) - seq_len + 1)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i, t = self.idx[k]
        return torch.from_numpy(self.obs[i][t:t + self.seq_len]), torch.from_numpy(self.act[i][t:t + self.seq_len])


class BCRNN(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden=1000, layers=2):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(obs_dim, 256), nn.BatchNorm1d(256), nn.ReLU(),
                                 nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU())
        self.rnn = nn.LSTM(256, hidden, layers, batch_first=True)
        self.out = nn.Linear(hidden, act_dim)

    def forward(self, obs, hx=None):
        B, T, _ = obs.shape
        z = self.enc(obs.reshape(B * T, -1)).reshape(B, T, -1)
        y, hx = self.rnn(z, hx)
        return torch.tanh(self.out(y)), hx


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    tot = torch.zeros(2, device=device)
    for obs, act in loader:
        obs, act = obs.to(device), act.to(device)
        pred, _ = net(obs)
        tot += torch.stack([((pred - act) ** 2).mean(-1).sum(), torch.tensor(float(pred.shape[0] * pred.shape[1]), device=device)])
    dist.all_reduce(tot)
    net.train()
    return (tot[0] / tot[1]).item()


def worker(rank, world_size, args, split, stats):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed + rank)

    train_set = SeqDataset(args.dataset, split["train"], args.seq_len, stats)
    val_set = SeqDataset(args.dataset, split["val"], args.seq_len, stats)
    train_sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # validation: a contiguous, non-overlapping slice per rank (no padding from DistributedSampler)
    per = (len(val_set) + world_size - 1) // world_size
    val_part = torch.utils.data.Subset(val_set, range(rank * per, min(len(val_set), (rank + 1) * per)))
    val_loader = DataLoader(val_part, 256, shuffle=False, num_workers=2)

    net = BCRNN(stats["mean"].shape[0], train_set.act[0].shape[1])
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(args.epochs * 0.6), int(args.epochs * 0.9)])

    best_path = os.path.join(args.out, "best.pth")
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0, run = time.time(), torch.zeros(2, device=device)
        for obs, act in train_loader:
            obs, act = obs.to(device, non_blocking=True), act.to(device, non_blocking=True)
            pred, _ = model(obs)
            loss = ((pred - act) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)
        val = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: train {(run[0] / run[1]).item():.5f} val {val:.5f} ({time.time() - t0:.1f}s)")
            if val < best:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": val, "stats": stats}, best_path)
        best = min(best, val)

    # everyone reloads the best weights for a last, full validation pass
    dist.barrier()
    ckpt = torch.load(best_path, map_location=device, weights_only=False)
    model.module.load_state_dict(ckpt["model"])
    final = validate(model.module, val_loader, device)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']}: val {final:.5f}")
    dist.destroy_process_group()


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    split, stats = load_split_and_stats(args.dataset, args.val_frac, args.seed)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args, split, stats), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
