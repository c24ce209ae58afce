#!/usr/bin/env python
"""FixMatch, single node, one process per GPU started with torch.multiprocessing.spawn.

    python 07_fixmatch_spawn.py --gpus 4 --num-labeled 250 --out results/fm_250

The labelled and the unlabelled batches go through the network in two separate
forward passes (the BatchNorm statistics of the labelled batch are not mixed with
those of the unlabelled batch).
"""
import argparse
import math
import os
import random
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dataset.cifar import DATASET_GETTERS
from models.wideresnet import build_wideresnet


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--port", type=int, default=23456)
    parser.add_argument("--dataset", default="cifar10", choices=["cifar10", "cifar100"])
    parser.add_argument("--data-root", default="./data")
    parser.add_argument("--num-labeled", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=64, help="global labelled batch")
    parser.add_argument("--mu", type=int, default=7)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--wdecay", type=float, default=5e-4)
    parser.add_argument("--total-steps", type=int, default=2 ** 20)
    parser.add_argument("--eval-step", type=int, default=1024)
    parser.add_argument("--threshold", type=float, default=0.95)
    parser.add_argument("--lambda-u", type=float, default=1.0)
    parser.add_argument("--ema-decay", type=float, default=0.999)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default="results/fixmatch")
    parser.add_argument("--resume", default="")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ModelEMA:
    def __init__(self, model, decay):
        self.ema = deepcopy(model).eval()
        self.decay = decay
        self.param_keys = [k for k, _ in self.ema.named_parameters()]
        self.buffer_keys = [k for k, _ in self.ema.named_buffers()]
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd, esd = model.state_dict(), self.ema.state_dict()
        for k in self.param_keys:
            esd[k].mul_(self.decay).add_(msd[k].detach(), alpha=1.0 - self.decay)
        for k in self.buffer_keys:
            esd[k].copy_(msd[k])


def lr_lambda_fn(total_steps, cycles=7.0 / 16.0):
    return lambda s: max(0.0, math.cos(math.pi * cycles * s / total_steps))


@torch.no_grad()
def gather_confident(labels, mask, device, world_size):
    """Collect the confident pseudo-labels of all ranks (counts differ from rank to rank)."""
    local = labels[mask]
    n = torch.tensor([local.numel()], device=device)
    counts = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(counts, n)
    max_n = int(max(c.item() for c in counts))
    padded = torch.full((max(max_n, 1),), -1, dtype=local.dtype, device=device)
    padded[: local.numel()] = local
    out = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(c.item())] for o, c in zip(out, counts)])


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    hit, tot = 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        hit += (model(x).argmax(-1) == y).sum().item()
        tot += y.size(0)
    return 100.0 * hit / tot


def main_worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=ngpus, rank=gpu)
    device = torch.device("cuda", gpu)
    set_seed(args.seed)
    num_classes = 10 if args.dataset == "cifar10" else 100

    if gpu != 0:
        dist.barrier()
    labeled_ds, unlabeled_ds, test_ds = DATASET_GETTERS[args.dataset](args)
    if gpu == 0:
        dist.barrier()

    bs = args.batch_size // ngpus
    labeled_sampler = DistributedSampler(labeled_ds, num_replicas=ngpus, rank=gpu, drop_last=True)
    unlabeled_sampler = DistributedSampler(unlabeled_ds, num_replicas=ngpus, rank=gpu, drop_last=True)
    labeled_loader = DataLoader(labeled_ds, batch_size=bs, sampler=labeled_sampler,
                                num_workers=args.workers, drop_last=True, pin_memory=True)
    unlabeled_loader = DataLoader(unlabeled_ds, batch_size=bs * args.mu, sampler=unlabeled_sampler,
                                  num_workers=args.workers, drop_last=True, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=256, shuffle=False, num_workers=args.workers)

    model = build_wideresnet(depth=28, widen_factor=2 if num_classes == 10 else 8,
                             dropout=0.0, num_classes=num_classes).to(device)
    ema = ModelEMA(model, args.ema_decay)
    model = DDP(model, device_ids=[gpu], broadcast_buffers=False)

    params = [
        {"params": [p for n, p in model.named_parameters() if "bn" not in n and "bias" not in n],
         "weight_decay": args.wdecay},
        {"params": [p for n, p in model.named_parameters() if "bn" in n or "bias" in n],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_fn(args.total_steps))

    start_step, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["state_dict"])
        ema.ema.load_state_dict(ckpt["ema_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_step, best_acc = ckpt["step"], ckpt["best_acc"]

    if gpu == 0:
        os.makedirs(args.out, exist_ok=True)
    l_epoch = start_step // len(labeled_loader)
    u_epoch = start_step // len(unlabeled_loader)
    labeled_sampler.set_epoch(l_epoch)
    unlabeled_sampler.set_epoch(u_epoch)
    l_iter, u_iter = iter(labeled_loader), iter(unlabeled_loader)

    model.train()
    t0 = time.time()
    for step in range(start_step, args.total_steps):
        try:
            x, y = next(l_iter)
        except StopIteration:
            l_epoch += 1
            labeled_sampler.set_epoch(l_epoch)
            l_iter = iter(labeled_loader)
            x, y = next(l_iter)
        try:
            (u_w, u_s), _ = next(u_iter)
        except StopIteration:
            u_epoch += 1
            unlabeled_sampler.set_epoch(u_epoch)
            u_iter = iter(unlabeled_loader)
            (u_w, u_s), _ = next(u_iter)

        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        u = torch.cat([u_w, u_s]).to(device, non_blocking=True)

        logits_x = model(x)
        logits_u_w, logits_u_s = model(u).chunk(2)
        loss_x = F.cross_entropy(logits_x, y)
        with torch.no_grad():
            conf, pseudo = torch.softmax(logits_u_w, dim=-1).max(dim=-1)
            mask = conf >= args.threshold
        loss_u = (F.cross_entropy(logits_u_s, pseudo, reduction="none") * mask.float()).mean()
        loss = loss_x + args.lambda_u * loss_u

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        ema.update(model.module)

        if (step + 1) % 256 == 0:
            confident = gather_confident(pseudo, mask, device, ngpus)
            if gpu == 0:
                hist = torch.bincount(confident, minlength=num_classes).float()
                hist = hist / hist.sum().clamp(min=1)
                print(f"step {step + 1} loss_x {loss_x.item():.4f} loss_u {loss_u.item():.4f} "
                      f"mask {mask.float().mean().item():.3f} n_conf {confident.numel()} "
                      f"pl-hist max/min {hist.max().item():.3f}/{hist.min().item():.3f} "
                      f"{(time.time() - t0) / 256:.3f}s/it", flush=True)
                t0 = time.time()

        if (step + 1) % args.eval_step == 0:
            if gpu == 0:
                acc = test(ema.ema, test_loader, device)
                best_acc = max(best_acc, acc)
                state = {"step": step + 1, "state_dict": model.module.state_dict(),
                         "ema_state_dict": ema.ema.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "best_acc": best_acc}
                torch.save(state, os.path.join(args.out, "checkpoint.pth"))
                if acc >= best_acc:
                    torch.save(state, os.path.join(args.out, "model_best.pth"))
                print(f"[eval] step {step + 1} top-1 {acc:.2f} best {best_acc:.2f}", flush=True)
            dist.barrier()
            model.train()

    dist.destroy_process_group()


def main():
    args = get_args()
    assert args.batch_size % args.gpus == 0, "global batch must split evenly over the GPUs"
    mp.spawn(main_worker, nprocs=args.gpus, args=(args.gpus, args))


if __name__ == "__main__":
    main()
