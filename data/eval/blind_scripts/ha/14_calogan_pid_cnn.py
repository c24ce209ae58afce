"""e+ / gamma / pi+ identification on the CaloGAN 3-layer LAr calorimeter images.

Each sample file (eplus.hdf5, gamma.hdf5, piplus.hdf5) has layer_0 (3x96),
layer_1 (12x12), layer_2 (12x6) and the incident energy. One CNN branch per layer,
concatenated with the per-layer energy fractions.

Launch on a node with 4 GPUs:
    torchrun --nproc_per_node=4 14_calogan_pid_cnn.py --data-dir /data/calogan --epochs 40
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PARTICLES = ["eplus", "gamma", "piplus"]


def parse_args():
    parser = argparse.ArgumentParser(description="CaloGAN particle ID")
    parser.add_argument("--data-dir", type=str, default="/data/calogan")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--val-frac", type=float, default=0.15)
    parser.add_argument("--save-dir", type=str, default="checkpoints/calogan_pid")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def load_data(data_dir):
    layers = [[], [], []]
    energy, labels = [], []
    for cls, name in enumerate(PARTICLES):
        with h5py.File(os.path.join(data_dir, f"{name}.hdf5"), "r") as f:
            for i in range(3):
                layers[i].append(f[f"layer_{i}"][:].astype(np.float32))
            energy.append(f["energy"][:].reshape(-1).astype(np.float32))
            labels.append(np.full(len(energy[-1]), cls, dtype=np.int64))
    layers = [torch.from_numpy(np.concatenate(l)).unsqueeze(1) for l in layers]
    return layers, torch.from_numpy(np.concatenate(energy)), torch.from_numpy(np.concatenate(labels))


class Branch(nn.Module):
    def __init__(self, kernel, out_dim=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, kernel, padding="same"), nn.LeakyReLU(0.2),
            nn.Conv2d(32, 32, kernel, padding="same"), nn.LeakyReLU(0.2),
            nn.Conv2d(32, 64, 3, padding="same"), nn.LeakyReLU(0.2),
            nn.AdaptiveAvgPool2d((2, 2)), nn.Flatten(), nn.Linear(256, out_dim), nn.LeakyReLU(0.2))

    def forward(self, x):
        return self.net(x)


class CaloPID(nn.Module):
    def __init__(self):
        super().__init__()
        self.b0 = Branch((3, 5))
        self.b1 = Branch((3, 3))
        self.b2 = Branch((3, 3))
        self.head = nn.Sequential(nn.Linear(3 * 64 + 4, 128), nn.LeakyReLU(0.2), nn.Dropout(0.2),
                                  nn.Linear(128, len(PARTICLES)))

    def forward(self, l0, l1, l2, e_inc):
        e_layers = torch.stack([l.sum(dim=(1, 2, 3)) for l in (l0, l1, l2)], 1)
        e_tot = e_layers.sum(1, keepdim=True).clamp(min=1e-3)
        fracs = e_layers / e_tot
        scale = lambda l: torch.log1p(l / 1000.0)
        h = torch.cat([self.b0(scale(l0)), self.b1(scale(l1)), self.b2(scale(l2)), fracs,
                       torch.log(e_tot / e_inc.unsqueeze(1).clamp(min=1.0))], dim=1)
        return self.head(h)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    (l0, l1, l2), e_inc, y = load_data(args.data_dir)
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(len(y), generator=g)
    n_val = int(args.val_frac * len(y))
    tr, va = perm[n_val:], perm[:n_val][rank::world_size]
    train_ds = TensorDataset(l0[tr], l1[tr], l2[tr], e_inc[tr], y[tr])
    val_ds = TensorDataset(l0[va], l1[va], l2[va], e_inc[va], y[va])

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1024, num_workers=2, pin_memory=True)

    model = CaloPID().to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"train {len(tr)}  val {n_val}  world size {world_size}", flush=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        loss_acc = torch.zeros(2, device=device)
        for b0, b1, b2, e, lab in train_loader:
            b0, b1, b2 = b0.to(device, non_blocking=True), b1.to(device, non_blocking=True), b2.to(device, non_blocking=True)
            e, lab = e.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            logits = model(b0, b1, b2, e)
            loss = F.cross_entropy(logits, lab)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_acc[0] += loss.detach() * lab.size(0)
            loss_acc[1] += lab.size(0)
        scheduler.step()
        dist.all_reduce(loss_acc)

        model.eval()
        conf = torch.zeros(len(PARTICLES), len(PARTICLES), device=device)
        with torch.no_grad():
            for b0, b1, b2, e, lab in val_loader:
                pred = model.module(b0.to(device), b1.to(device), b2.to(device), e.to(device)).argmax(1)
                lab = lab.to(device)
                conf.index_put_((lab, pred), torch.ones_like(lab, dtype=conf.dtype), accumulate=True)
        dist.all_reduce(conf)
        acc = (conf.diag().sum() / conf.sum()).item()

        if rank == 0:
            eff = (conf.diag() / conf.sum(1)).tolist()
            print(f"epoch {epoch:02d} loss {(loss_acc[0] / loss_acc[1]).item():.4f} acc {acc:.4f} "
                  + " ".join(f"eff_{p}={e:.3f}" for p, e in zip(PARTICLES, eff))
                  + f" [{time.time() - start:.0f}s]", flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "confusion": conf.cpu()}, os.path.join(args.save_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
