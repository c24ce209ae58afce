"""Sunflower plant counting per orthomosaic tile, with whole fields pinned to ranks.

The tiles of one field live in one zarr store on the shared file system;
reading a store from one process is much faster than having every rank
touch every store, so each rank gets whole fields (balanced greedily by tile
count). The shards differ slightly in size, so every rank runs the step
count of the largest shard and the smaller ones wrap around their own tiles.

    torchrun --nproc_per_node=4 15_sunflower_count_field_shards.py --stores /data/sunflower/zarr
"""
import argparse
import glob
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stores", required=True, help="folder with one <field>.zarr per field")
    p.add_argument("--val-fields", nargs="+", default=["F07", "F12"])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="runs/sunflower_count")
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args()


class FieldTiles(Dataset):
    """Concatenation of per-field zarr stores: images (N, 3, 384, 384) uint8 and counts (N,)."""

    def __init__(self, store_paths, train):
        self.fields, self.offsets = [], [0]
        for p in store_paths:
            z = zarr.open(p, mode="r")
            self.fields.append((os.path.basename(p).replace(".zarr", ""), z))
            self.offsets.append(self.offsets[-1] + z["counts"].shape[0])
        self.train = train
        self.mean = torch.tensor([0.45, 0.47, 0.35]).view(3, 1, 1)
        self.std = torch.tensor([0.20, 0.19, 0.18]).view(3, 1, 1)

    def __len__(self):
        return self.offsets[-1]

    def field_ranges(self):
        return [(name, range(self.offsets[i], self.offsets[i + 1])) for i, (name, _) in enumerate(self.fields)]

    def __getitem__(self, idx):
        f = int(np.searchsorted(self.offsets, idx, side="right")) - 1
        z = self.fields[f][1]
        j = idx - self.offsets[f]
        x = torch.from_numpy(np.asarray(z["images"][j])).float() / 255.0
        y = float(z["counts"][j])
        if self.train:
            k = int(torch.randint(0, 4, (1,)))
            x = torch.rot90(x, k, dims=(1, 2))
            if torch.rand(1) < 0.5:
                x = x.flip(2)
            x = (x * (0.8 + 0.4 * torch.rand(1)) + 0.08 * (torch.rand(3, 1, 1) - 0.5)).clamp(0, 1)
        return (x - self.mean) / self.std, torch.tensor(y)


class FieldShardSampler(Sampler):
    """Assigns whole fields to ranks (largest first, to the lightest rank); shuffles within the shard."""

    def __init__(self, dataset, rank, world, seed=0, shuffle=True):
        loads = [0] * world
        shards = [[] for _ in range(world)]
        for name, rng in sorted(dataset.field_ranges(), key=lambda t: (-len(t[1]), t[0])):
            r = int(np.argmin(loads))
            shards[r].extend(rng)
            loads[r] += len(rng)
        self.indices = shards[rank]
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(self.indices)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter([self.indices[i] for i in torch.randperm(len(self.indices), generator=g).tolist()])

    def __len__(self):
        return len(self.indices)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        # ConvNeXt has LayerNorm only, no BatchNorm buffers to keep in sync
        self.backbone = timm.create_model("convnext_small.fb_in22k", pretrained=True, num_classes=0)
        self.head = nn.Linear(self.backbone.num_features, 1)

    def forward(self, x):
        return F.softplus(self.head(self.backbone(x))).squeeze(1)


def cycle_batches(loader, n_steps):
    """Yield exactly n_steps batches, starting the loader again when it runs out."""
    it = iter(loader)
    for _ in range(n_steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        yield batch


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    stores = sorted(glob.glob(os.path.join(args.stores, "*.zarr")))
    is_val = lambda p: os.path.basename(p).replace(".zarr", "") in args.val_fields
    train_ds = FieldTiles([p for p in stores if not is_val(p)], train=True)
    val_ds = FieldTiles([p for p in stores if is_val(p)], train=False)
    train_sampler = FieldShardSampler(train_ds, rank, world, seed=args.seed)
    val_sampler = FieldShardSampler(val_ds, rank, world, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=args.workers)

    net = Counter().to(device)
    model = DDP(net, device_ids=[local_rank])
    # lr is given for a global batch of 128
    lr = args.lr * args.batch_size * world / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    # same number of optimizer steps on every rank: the largest shard's
    steps = torch.tensor([len(train_loader)], device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    steps_per_epoch = int(steps.item())
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    print(f"rank {rank}: {len(train_sampler)} train tiles, {len(val_sampler)} val tiles", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in cycle_batches(train_loader, steps_per_epoch):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = F.smooth_l1_loss(pred.float(), y, beta=2.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(acc)

        net.eval()
        err = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                p = net(x).double()
                err += torch.stack([(p - y).abs().sum(), ((p - y) ** 2).sum(),
                                    torch.tensor(float(len(y)), device=device, dtype=torch.float64)])
        dist.all_reduce(err)
        mae, rmse = (err[0] / err[2]).item(), (err[1] / err[2]).sqrt().item()
        if rank == 0:
            print(f"epoch {epoch}  train {(acc[0] / acc[1]).item():.3f}  val MAE {mae:.2f}  RMSE {rmse:.2f}  "
                  f"{time.time() - t0:.0f}s", flush=True)
            if mae < best:
                best = mae
                torch.save({"model": net.state_dict(), "epoch": epoch, "mae": mae}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
