"""
2:4 (N:M) semi-structured sparsity for a ResNet-50 on ImageNet, trained with
gradient accumulation. Masks live as buffers in a weight parametrization of each conv / linear
and are recomputed from the current weights every --remask-every optimizer steps
(SR-STE style decay on pruned weights). Supports resuming from the last
checkpoint, masks included.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        nm_sparse_r50.py --data /shared/imagenet --out /shared/exp/r50_2of4 --resume
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.256, help="for a global batch of 1024")
    p.add_argument("--N", type=int, default=2)
    p.add_argument("--M", type=int, default=4)
    p.add_argument("--srste-decay", type=float, default=2e-4)
    p.add_argument("--remask-every", type=int, default=100)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class _STEMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, mask):
        return w * mask

    @staticmethod
    def backward(ctx, grad):
        # straight-through: the dense weight receives the full gradient
        return grad, None


class NMMask(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.register_buffer("mask", torch.ones_like(weight))

    def forward(self, w):
        return _STEMask.apply(w, self.mask)


def add_nm_parametrizations(model, M):
    targets = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)) and m.weight[0].numel() % M == 0 and name != "conv1":
            parametrize.register_parametrization(m, "weight", NMMask(m.weight))
            targets.append(m)
    return targets


@torch.no_grad()
def recompute_nm_masks(targets, N, M):
    for m in targets:
        w = m.parametrizations.weight.original
        if w.dim() == 4:  # group M consecutive input channels at each (out, kh, kw)
            g = w.permute(0, 2, 3, 1).reshape(-1, M)
        else:
            g = w.reshape(-1, M)
        idx = g.abs().topk(N, dim=1).indices
        mask = torch.zeros_like(g).scatter_(1, idx, 1.0)
        if w.dim() == 4:
            mask = mask.reshape(w.shape[0], w.shape[2], w.shape[3], w.shape[1]).permute(0, 3, 1, 2)
        m.parametrizations.weight[0].mask.copy_(mask.reshape(w.shape))


@torch.no_grad()
def srste_decay(targets, decay, lr):
    for m in targets:
        # SR-STE: pull pruned weights towards zero instead of hard-zeroing them during training
        w = m.parametrizations.weight.original
        w.sub_(decay * lr * (1 - m.parametrizations.weight[0].mask) * w)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    r = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        r[0] += (model(x).argmax(1) == y).sum()
        r[1] += y.numel()
    dist.all_reduce(r)
    return (100 * r[0] / r[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), T.Compose(
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), T.Compose(
        [T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 200, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    net = torchvision.models.resnet50(weights="IMAGENET1K_V2")
    targets = add_nm_parametrizations(net, args.M)
    net = net.to(device)
    recompute_nm_masks(targets, args.N, args.M)
    model = DDP(net, device_ids=[local_rank])

    global_bs = args.batch_size * args.accum * world
    lr = args.lr * global_bs / 1024
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.875, weight_decay=3.05e-5, nesterov=True)
    updates_per_epoch = len(train_loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=updates_per_epoch, pct_start=0.05)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.pth")
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        if ckpt["world_size"] != world:
            raise SystemExit(f"checkpoint was written with {ckpt['world_size']} ranks, this job has {world}; "
                             "the OneCycle schedule and global batch are tied to the world size")
        net.load_state_dict(ckpt["model"])  # includes the mask buffers
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}, best top1 so far {best:.2f}")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {global_bs}, lr {lr:.3f}, {len(targets)} sparse layers", flush=True)

    n_updates = start_epoch * updates_per_epoch
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            if i >= updates_per_epoch * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1) / args.accum
                loss.backward()
            if not last_micro:
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            srste_decay(targets, args.srste_decay, sched.get_last_lr()[0])
            n_updates += 1
            if n_updates % args.remask_every == 0:
                recompute_nm_masks(targets, args.N, args.M)
            if rank == 0 and n_updates % 100 == 0:
                print(f"ep {epoch} upd {n_updates} loss {loss.item() * args.accum:.4f}", flush=True)

        top1 = evaluate(model, val_loader, device)
        kept = torch.zeros(2, device=device)
        for m in targets:
            mask = m.parametrizations.weight[0].mask
            kept[0] += mask.sum()
            kept[1] += mask.numel()
        if rank == 0:
            best = max(best, top1)
            print(f"epoch {epoch} top1 {top1:.2f} (best {best:.2f}) density {(kept[0] / kept[1]).item():.3f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "best": best, "world_size": world},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
