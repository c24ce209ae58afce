"""Loss-based importance sampling for long-tailed classification (iNaturalist-style
ImageFolder), DDP with gradient accumulation.

Per-sample losses of the epoch are all-gathered, folded into a global loss table,
and the table is turned into sampling weights for the next epoch.

    torchrun --nproc_per_node=8 04_dist_weighted_sampler.py --data /datasets/inat21_mini \
        --model convnext_tiny --accum 2 --out runs/inat_is
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import datasets, transforms


class Indexed(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, i


class DistributedWeightedSampler(Sampler):
    def __init__(self, weights, num_replicas, rank, seed=0):
        self.weights = weights.double().cpu()
        self.num_replicas = num_replicas
        self.rank = rank
        self.num_samples = math.ceil(len(self.weights) / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        draw = torch.multinomial(self.weights, self.total_size, replacement=True, generator=g)
        return iter(draw[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


def make_weights(loss_table, class_of, num_classes, temperature, floor):
    # normalise losses within each class so head classes don't dominate
    cls_mean = torch.zeros(num_classes, device=loss_table.device).index_reduce_(
        0, class_of, loss_table, "mean", include_self=False)
    rel = loss_table / cls_mean[class_of].clamp(min=1e-6)
    w = torch.softmax(rel / temperature, dim=0)
    w = w / w.sum()
    return (1 - floor) * w + floor / w.numel()


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="convnext_tiny")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU, per micro-step")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=4e-3, help="for an effective batch of 4096")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--floor", type=float, default=0.5, help="uniform mixing")
    p.add_argument("--ema", type=float, default=0.7)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="runs/inat_is")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p


def main():
    args = args_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)  # different augmentation stream per rank

    tf_train = timm.data.create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5")
    tf_val = timm.data.create_transform(224, is_training=False)
    base = datasets.ImageFolder(os.path.join(args.data, "train"), tf_train)
    train_set = Indexed(base)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), tf_val)
    n, num_classes = len(train_set), len(base.classes)
    class_of = torch.tensor(base.targets, device=device)

    loss_table = torch.full((n,), math.log(num_classes), device=device)
    sampler = DistributedWeightedSampler(torch.ones(n), world, rank, seed=args.seed)

    model = timm.create_model(args.model, num_classes=num_classes, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    eff_batch = args.batch_size * args.accum * world
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * eff_batch / 4096, weight_decay=0.05)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loss_table.copy_(ckpt["loss_table"].to(device))
        sampler.weights = ckpt["weights"].double()
        start_epoch = ckpt["epoch"] + 1

    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=256,
                            num_workers=args.workers, pin_memory=True)
    updates_per_epoch = len(loader) // args.accum
    total_updates = args.epochs * updates_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=optimizer.param_groups[0]["lr"],
                                                total_steps=total_updates, pct_start=0.05)
    for _ in range(start_epoch * updates_per_epoch):
        sched.step()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        seen_idx, seen_loss = [], []
        optimizer.zero_grad(set_to_none=True)
        t0 = time.time()
        micro = 0
        for x, y, idx in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            micro += 1
            sync_now = micro % args.accum == 0
            ctx = model.no_sync() if not sync_now else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    per = F.cross_entropy(model(x), y, reduction="none", label_smoothing=0.1)
                (per.mean() / args.accum).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sched.step()
            seen_idx.append(idx.to(device))
            seen_loss.append(per.detach().float())
        # len(loader) is the same on all ranks, so these tensors have the same length everywhere
        local_idx, local_loss = torch.cat(seen_idx), torch.cat(seen_loss)
        all_idx = torch.empty(world * local_idx.numel(), dtype=local_idx.dtype, device=device)
        all_loss = torch.empty(world * local_loss.numel(), device=device)
        dist.all_gather_into_tensor(all_idx, local_idx)
        dist.all_gather_into_tensor(all_loss, local_loss)

        s = torch.zeros(n, device=device).index_add_(0, all_idx, all_loss)
        c = torch.zeros(n, device=device).index_add_(0, all_idx, torch.ones_like(all_loss))
        hit = c > 0
        loss_table[hit] = args.ema * loss_table[hit] + (1 - args.ema) * (s[hit] / c[hit])

        # rank 0 decides the weights; broadcasting keeps the sampler draw bit-identical
        weights = make_weights(loss_table, class_of, num_classes, args.temperature, args.floor)
        dist.broadcast(weights, src=0)
        dist.broadcast(loss_table, src=0)
        sampler.weights = weights.double().cpu()

        model.eval()
        tally = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(x).argmax(1)
                tally += torch.stack([(pred == y).sum().float(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(tally)

        if rank == 0:
            print(f"[{epoch}] val_acc={tally[0] / tally[1]:.4f} coverage={hit.float().mean():.3f} "
                  f"max_w*n={weights.max() * n:.2f} time={time.time() - t0:.0f}s", flush=True)
            os.makedirs(args.out, exist_ok=True)
            tmp = os.path.join(args.out, "ckpt.pt.tmp")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "loss_table": loss_table.cpu(), "weights": weights.cpu(), "epoch": epoch}, tmp)
            os.replace(tmp, os.path.join(args.out, "ckpt.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
