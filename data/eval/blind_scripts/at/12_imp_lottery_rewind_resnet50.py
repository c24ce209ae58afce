"""
Iterative magnitude pruning with weight rewinding (Frankle et al., "Linear mode
connectivity and the lottery ticket hypothesis") on ImageNet / ResNet-50.

Each round: train for --round-epochs, globally prune --prune-frac of the
remaining conv/fc weights by magnitude, rewind the surviving weights to their
values at --rewind-epoch, repeat. Masks are kept as a dict of bool tensors and
applied to weights and gradients every step.

    torchrun --nproc_per_node=8 imp_rewind.py --data /data/imagenet --rounds 8
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--round-epochs", type=int, default=16)
    p.add_argument("--rewind-epoch", type=int, default=2)
    p.add_argument("--prune-frac", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.4)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="/shared/imp_r50")
    return p.parse_args()


def prunable_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


@torch.no_grad()
def global_magnitude_prune(model, masks, frac):
    modules = dict(model.named_modules())
    alive = torch.cat([modules[n].weight[masks[n]].abs().flatten() for n in masks])
    k = int(frac * alive.numel())
    thresh = alive.kthvalue(k).values
    for n in masks:
        masks[n] &= modules[n].weight.abs() > thresh


@torch.no_grad()
def apply_masks(model, masks):
    modules = dict(model.named_modules())
    for n, m in masks.items():
        modules[n].weight.mul_(m)


def mask_grads(model, masks):
    modules = dict(model.named_modules())
    for n, m in masks.items():
        g = modules[n].weight.grad
        if g is not None:
            g.mul_(m)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (model(x).argmax(1) == y).sum().item()
        total += y.size(0)
    return 100.0 * correct / total


def density(masks):
    alive = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    return alive / total


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 250, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    net = torchvision.models.resnet50().to(device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DDP(net, device_ids=[local_rank])
    masks = {n: torch.ones_like(dict(net.named_modules())[n].weight, dtype=torch.bool)
             for n in prunable_names(net)}

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    rewind_state = None
    global_epoch = 0
    for rnd in range(args.rounds):
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.round_epochs * len(train_loader),
                                                    pct_start=0.1)
        best_top1 = 0.0
        start_ep = 0 if rewind_state is None else args.rewind_epoch
        for _ in range(start_ep):
            for _ in range(len(train_loader)):
                sched.step()
        for ep in range(start_ep, args.round_epochs):
            train_sampler.set_epoch(global_epoch)
            model.train()
            t0 = time.time()
            for x, y in train_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                mask_grads(net, masks)
                opt.step()
                sched.step()
                apply_masks(net, masks)
            global_epoch += 1

            if rnd == 0 and ep + 1 == args.rewind_epoch:
                rewind_state = copy.deepcopy(net.state_dict())

            top1 = evaluate(model, val_loader, device)
            if rank == 0:
                print(f"round {rnd} ep {ep} density {density(masks):.4f} top1 {top1:.2f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                if top1 > best_top1:
                    best_top1 = top1
                    torch.save({"round": rnd, "epoch": ep, "model": net.state_dict(),
                                "masks": {k: v.cpu() for k, v in masks.items()}, "top1": top1},
                               os.path.join(args.out, f"round{rnd}_best.pth"))

        if rank == 0:
            print(f"== round {rnd} done: density {density(masks):.4f} best top1 {best_top1:.2f}", flush=True)
        global_magnitude_prune(net, masks, args.prune_frac)
        net.load_state_dict(rewind_state)
        apply_masks(net, masks)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
