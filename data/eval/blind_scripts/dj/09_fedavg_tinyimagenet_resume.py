"""FedAvg on Tiny-ImageNet (200 classes), ResNet-18 with GroupNorm.

One client per GPU, Dirichlet non-IID split, client learning rate decayed per
round, periodic global evaluation. Long runs are restarted from a checkpoint:

    torchrun --nnodes=1 --nproc_per_node=8 09_fedavg_tinyimagenet_resume.py \
        --resume runs/tin_fedavg/round_0150.pt
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Subset
from torchvision import transforms as T


def args_from_cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/tiny-imagenet-200")
    ap.add_argument("--run_dir", default="runs/tin_fedavg")
    ap.add_argument("--resume", default="")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--local_epochs", type=int, default=1)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--lr_min", type=float, default=0.001)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--save_every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def resnet18_gn(num_classes):
    net = torchvision.models.resnet18(num_classes=num_classes,
                                      norm_layer=lambda c: nn.GroupNorm(32, c))
    # 64x64 inputs: smaller stem, no max-pool
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


def client_lr(args, rnd):
    cos = 0.5 * (1 + math.cos(math.pi * rnd / args.rounds))
    return args.lr_min + (args.lr - args.lr_min) * cos


def dirichlet(labels, n_clients, alpha, seed):
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    buckets = [[] for _ in range(n_clients)]
    for c in np.unique(labels):
        ids = rng.permutation(np.flatnonzero(labels == c))
        props = rng.dirichlet(np.full(n_clients, alpha))
        for k, part in enumerate(np.split(ids, (np.cumsum(props)[:-1] * len(ids)).astype(int))):
            buckets[k].extend(part.tolist())
    return buckets


def train_one_client(model, loader, lr, epochs, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    running, steps = 0.0, 0
    for _ in range(epochs):
        for img, tgt in loader:
            img = img.to(device, non_blocking=True)
            tgt = tgt.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), tgt, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            running += loss.item()
            steps += 1
    return running / max(1, steps)


@torch.no_grad()
def fed_average(model, n_local, device):
    coef = torch.tensor([n_local], dtype=torch.float64, device=device)
    denom = coef.clone()
    dist.all_reduce(denom)
    coef = float(coef / denom)
    for v in model.state_dict().values():
        if v.is_floating_point():
            v.mul_(coef)
            dist.all_reduce(v)


@torch.no_grad()
def global_eval(model, loader, device):
    model.eval()
    s = torch.zeros(3, dtype=torch.float64, device=device)
    for img, tgt in loader:
        img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        logits = model(img)
        top5 = logits.topk(5, 1).indices
        s[0] += (top5[:, 0] == tgt).sum()
        s[1] += (top5 == tgt[:, None]).any(1).sum()
        s[2] += tgt.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = args_from_cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    mean, std = (0.480, 0.448, 0.398), (0.277, 0.269, 0.282)
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.root, "train"),
        T.Compose([T.RandomResizedCrop(64, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                   T.ToTensor(), T.Normalize(mean, std)]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.root, "val_sorted"), T.Compose([T.ToTensor(), T.Normalize(mean, std)]))

    parts = dirichlet(train_ds.targets, world, args.alpha, args.seed)
    n_local = len(parts[rank])
    train_loader = DataLoader(Subset(train_ds, parts[rank]), batch_size=args.bs, shuffle=True,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256,
                            num_workers=2, pin_memory=True)

    model = resnet18_gn(len(train_ds.classes)).to(device)
    start_round = 0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        start_round = ckpt["round"]
        del ckpt
    else:
        for v in model.state_dict().values():
            dist.broadcast(v, src=0)

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        print(f"clients={world} local_sizes(rank0)={n_local} start_round={start_round}", flush=True)

    for rnd in range(start_round, args.rounds):
        tic = time.time()
        lr = client_lr(args, rnd)
        loss = train_one_client(model, train_loader, lr, args.local_epochs, device)
        fed_average(model, n_local, device)
        loss_t = torch.tensor([loss * n_local, n_local], dtype=torch.float64, device=device)
        dist.all_reduce(loss_t)

        done = rnd + 1
        line = f"round {done:4d} lr {lr:.4f} train_loss {(loss_t[0] / loss_t[1]).item():.4f}"
        if done % args.eval_every == 0 or done == args.rounds:
            top1, top5 = global_eval(model, val_loader, device)
            line += f" top1 {top1:.4f} top5 {top5:.4f}"
        if rank == 0:
            print(line + f" ({time.time() - tic:.1f}s)", flush=True)
            if done % args.save_every == 0 or done == args.rounds:
                torch.save({"round": done, "model": model.state_dict(), "args": vars(args)},
                           os.path.join(args.run_dir, f"round_{done:04d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
