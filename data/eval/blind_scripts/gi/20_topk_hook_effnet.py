"""
Top-k sparsified all-reduce as a DDP communication hook, with per-bucket
error feedback, for EfficientNet-B2 on a plant-disease image folder (one
folder per class, no official validation split).

The first --dense-iters iterations use the normal all-reduce (DDP rebuilds its
buckets after the first iteration and the residuals are keyed by bucket index).

    torchrun --nproc_per_node=8 20_topk_hook_effnet.py --data /data/plantvillage --density 0.01
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


class TopKState:
    def __init__(self, process_group, density, dense_iters):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.density = density
        self.dense_iters = dense_iters
        self.residuals = {}
        self.iter = 0

    def maybe_increase_iter(self, bucket):
        if bucket.is_last():
            self.iter += 1


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if state.iter < state.dense_iters:
        state.maybe_increase_iter(bucket)
        buf.div_(state.world_size)
        fut = dist.all_reduce(buf, group=state.process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    idx_b = bucket.index()
    res = state.residuals.get(idx_b)
    if res is None or res.numel() != buf.numel():
        res = torch.zeros_like(buf)
        state.residuals[idx_b] = res
    acc = buf + res
    k = max(1, int(buf.numel() * state.density))
    _, idx = torch.topk(acc.abs(), k, sorted=False)
    vals = acc[idx]
    res.copy_(acc)
    res[idx] = 0

    ws = state.world_size
    all_vals = torch.empty(ws * k, device=buf.device, dtype=vals.dtype)
    all_idx = torch.empty(ws * k, device=buf.device, dtype=idx.dtype)
    f_vals = dist.all_gather_into_tensor(all_vals, vals, group=state.process_group, async_op=True).get_future()
    f_idx = dist.all_gather_into_tensor(all_idx, idx, group=state.process_group, async_op=True).get_future()
    state.maybe_increase_iter(bucket)

    def decompress(_):
        out = bucket.buffer()
        out.zero_()
        out.index_add_(0, all_idx, all_vals)
        out.div_(ws)
        return out

    return torch.futures.collect_all([f_vals, f_idx]).then(decompress)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=48)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--dense-iters", type=int, default=200)
    ap.add_argument("--val-frac", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/plant_topk")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(260, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(288), transforms.CenterCrop(260), transforms.ToTensor(), norm])
    full_train = datasets.ImageFolder(args.data, transform=train_tf)
    full_val = datasets.ImageFolder(args.data, transform=val_tf)
    n_val = int(len(full_train) * args.val_frac)
    train_idx, val_idx = random_split(range(len(full_train)), [len(full_train) - n_val, n_val])
    train_set = torch.utils.data.Subset(full_train, list(train_idx))
    val_set = torch.utils.data.Subset(full_val, list(val_idx))
    classes = full_train.classes

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                        num_workers=8, pin_memory=True)

    model = models.efficientnet_b2(weights=models.EfficientNet_B2_Weights.IMAGENET1K_V1)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, len(classes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    state = TopKState(dist.group.WORLD, args.density, args.dense_iters)
    model.register_comm_hook(state, topk_hook)

    lr = args.lr * args.bs * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-5, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "classes.json"), "w") as f:
            json.dump(classes, f)
        print(f"{len(train_set)} train / {len(val_set)} val images, {len(classes)} classes, lr {lr:.3f}")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 50 == 0:
                print(f"ep {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f}")

        model.eval()
        s = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                s[0] += (model(x).argmax(1) == y).sum()
                s[1] += y.numel()
        dist.all_reduce(s)
        acc = (s[0] / s[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val_acc {acc:.4f} ({time.time() - t0:.0f}s)")
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "classes": classes, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
