"""Quark/gluon discrimination with a Particle Flow Network (Komiske, Metodiev, Thaler).

Uses the Pythia8 QG_jets_*.npz files from EnergyFlow (with charm/bottom variant
off). Each jet: up to M particles with (pt, y, phi, pid); label 1 = quark.

    torchrun --nproc_per_node=8 07_qg_pfn_tagger.py --data /data/qg_jets --epochs 40 \
        --batch-size 64 --accum 2
"""
import argparse
import glob
import math
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

# fixed PDG id -> embedding index table (same on every rank and every run)
PID_TABLE = {0: 0, 22: 1, 211: 2, -211: 3, 321: 4, -321: 5, 130: 6, 2112: 7, -2112: 8,
             2212: 9, -2212: 10, 11: 11, -11: 12, 13: 13, -13: 14}


class QGJets(Dataset):
    def __init__(self, files):
        xs, ys = [], []
        for fn in files:
            with np.load(fn) as d:
                xs.append(d["X"])
                ys.append(d["y"])
        max_m = max(x.shape[1] for x in xs)
        xs = [np.pad(x, ((0, 0), (0, max_m - x.shape[1]), (0, 0))) for x in xs]
        X = np.concatenate(xs).astype(np.float32)
        self.y = np.concatenate(ys).astype(np.int64)
        mask = X[..., 0] > 0
        pt = X[..., 0]
        y_mean = np.average(X[..., 1], weights=pt + 1e-12, axis=1)
        phi_mean = np.average(X[..., 2], weights=pt + 1e-12, axis=1)
        self.kin = np.stack([pt / pt.sum(1, keepdims=True),
                             (X[..., 1] - y_mean[:, None]) * mask,
                             (X[..., 2] - phi_mean[:, None]) * mask], axis=-1).astype(np.float32)
        lookup = np.vectorize(lambda p: PID_TABLE.get(int(p), 0))
        self.pid = lookup(X[..., 3]).astype(np.int64)
        self.mask = mask

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.kin[i], self.pid[i], self.mask[i], self.y[i]


class PFN(nn.Module):
    def __init__(self, n_pid=len(PID_TABLE), pid_dim=8, phi=(100, 100, 256), F_sizes=(100, 100, 100)):
        super().__init__()
        self.pid_emb = nn.Embedding(n_pid, pid_dim, padding_idx=0)
        layers, c = [], 3 + pid_dim
        for h in phi:
            layers += [nn.Conv1d(c, h, 1), nn.BatchNorm1d(h), nn.ReLU()]
            c = h
        self.phi = nn.Sequential(*layers)
        layers = []
        for h in F_sizes:
            layers += [nn.Linear(c, h), nn.BatchNorm1d(h), nn.ReLU()]
            c = h
        self.F = nn.Sequential(*layers, nn.Linear(c, 2))

    def forward(self, kin, pid, mask):
        x = torch.cat([kin, self.pid_emb(pid)], dim=-1).transpose(1, 2)
        h = self.phi(x) * mask.unsqueeze(1)
        return self.F(h.sum(-1))


def cosine_with_warmup(opt, warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/qg_jets")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU, per micro-step")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base-lr", type=float, default=1e-3, help="for a global batch of 256")
    ap.add_argument("--warmup-epochs", type=float, default=2)
    ap.add_argument("--out", default="checkpoints/qg_pfn")
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.data, "QG_jets_*.npz")))
    assert len(files) >= 10, files
    train_ds = QGJets(files[:8])
    val_ds = QGJets(files[8:10])
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=1024, num_workers=2)

    model = PFN()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = DDP(model, device_ids=[local_rank])

    # linear scaling rule: lr follows the global batch (per-GPU batch x GPUs x accumulation)
    global_batch = args.batch_size * world * args.accum
    lr = args.base_lr * global_batch / 256
    opt = torch.optim.Adam(ddp.parameters(), lr=lr)
    updates_per_epoch = math.ceil(len(loader) / args.accum)
    sched = cosine_with_warmup(opt, int(args.warmup_epochs * updates_per_epoch),
                               args.epochs * updates_per_epoch)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        # older checkpoints were written from the DDP wrapper
        state = {k.removeprefix("module."): v for k, v in ckpt["model"].items()}
        model.load_state_dict(state)
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {global_batch}, lr {lr:.2e}, {len(loader)} micro-steps/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        opt.zero_grad(set_to_none=True)
        run = torch.zeros(2, device=device)
        for i, (kin, pid, mask, y) in enumerate(loader):
            kin, pid = kin.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            mask, y = mask.to(device, non_blocking=True), y.to(device, non_blocking=True)
            do_step = (i + 1) % args.accum == 0 or (i + 1) == len(loader)
            with nullcontext() if do_step else ddp.no_sync():
                loss = F.cross_entropy(ddp(kin, pid, mask), y)
                (loss / args.accum).backward()
            if do_step:
                nn.utils.clip_grad_norm_(ddp.parameters(), 2.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            run += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(run)

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for kin, pid, mask, y in val_loader:
                kin, pid, mask, y = kin.to(device), pid.to(device), mask.to(device), y.to(device)
                correct[0] += (model(kin, pid, mask).argmax(1) == y).sum()
                correct[1] += y.numel()
        dist.all_reduce(correct)

        if rank == 0:
            print(f"epoch {epoch:02d} loss {(run[0] / run[1]).item():.4f} "
                  f"val_acc {(correct[0] / correct[1]).item():.4f}", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
