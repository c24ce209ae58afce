#!/usr/bin/env python3
"""Sintel fine-tuning stage of RAFT (C+T+S+K+H mix), multi-GPU.

    torchrun --standalone --nproc_per_node=8 07_raft_sintel_finetune.py \
        --restore_ckpt checkpoints/raft-things.pth --exp raft-sintel-ft
"""
import argparse
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "core"))
from raft import RAFT  # noqa: E402
from utils.utils import InputPadder  # noqa: E402
import datasets  # noqa: E402


def get_parser():
    parser = argparse.ArgumentParser("RAFT sintel fine-tuning")
    parser.add_argument("--exp", default="raft-sintel-ft")
    parser.add_argument("--restore_ckpt", required=True)
    parser.add_argument("--output", default="checkpoints")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--alternate_corr", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=1.25e-4)
    parser.add_argument("--wdecay", type=float, default=1e-5)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--per_gpu_batch", type=int, default=1)
    parser.add_argument("--image_size", type=int, nargs=2, default=[368, 768])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--gamma", type=float, default=0.85)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--val_every", type=int, default=10000)
    parser.add_argument("--num_workers", type=int, default=4)
    return parser


def sequence_loss(flow_preds, flow_gt, valid, gamma, max_flow=400.0):
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    n = len(flow_preds)
    loss = 0.0
    for i, pred in enumerate(flow_preds):
        weight = gamma ** (n - i - 1)
        loss = loss + weight * (valid[:, None] * (pred - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()[valid]
    return loss, epe.mean().detach()


def build_train_set(args):
    size = args.image_size
    things = datasets.FlyingThings3D({"crop_size": size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True},
                                     dstype="frames_cleanpass")
    sintel_aug = {"crop_size": size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
    sintel_clean = datasets.MpiSintel(sintel_aug, split="training", dstype="clean")
    sintel_final = datasets.MpiSintel(sintel_aug, split="training", dstype="final")
    kitti = datasets.KITTI({"crop_size": size, "min_scale": -0.3, "max_scale": 0.5, "do_flip": True})
    hd1k = datasets.HD1K({"crop_size": size, "min_scale": -0.5, "max_scale": 0.2, "do_flip": True})
    return 100 * sintel_clean + 100 * sintel_final + 200 * kitti + 5 * hd1k + things


@torch.no_grad()
def validate_sintel(model, iters, device, rank, world):
    """EPE on the Sintel training split, each rank takes every world-th frame."""
    model.eval()
    results = {}
    for dstype in ["clean", "final"]:
        val_dataset = datasets.MpiSintel(split="training", dstype=dstype)
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        for val_id in range(rank, len(val_dataset), world):
            image1, image2, flow_gt, _ = val_dataset[val_id]
            image1 = image1[None].to(device)
            image2 = image2[None].to(device)
            padder = InputPadder(image1.shape)
            image1, image2 = padder.pad(image1, image2)
            _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
            flow = padder.unpad(flow_pr[0]).cpu()
            epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt()
            acc[0] += epe.sum()
            acc[1] += epe.numel()
        dist.all_reduce(acc)
        results[dstype] = (acc[0] / acc[1]).item()
    model.train()
    model.freeze_bn()
    return results


def main():
    args = get_parser().parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    np.random.seed(1234 + rank)

    model = RAFT(args)
    ckpt = torch.load(args.restore_ckpt)
    ckpt = {k[len("module."):] if k.startswith("module.") else k: v for k, v in ckpt.items()}
    missing, unexpected = model.load_state_dict(ckpt, strict=False)
    if rank == 0:
        print(f"restored {args.restore_ckpt}: {len(missing)} missing, {len(unexpected)} unexpected keys")
    model = model.to(device)
    model.train()
    model.freeze_bn()
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    train_set = build_train_set(args)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    loader = DataLoader(train_set, batch_size=args.per_gpu_batch, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    # reference recipe: lr 1.25e-4 for a global batch of 6; scale linearly
    lr = args.lr * (args.per_gpu_batch * world) / 6.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    out_dir = os.path.join(args.output, args.exp)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        print(f"{len(train_set)} training pairs, world size {world}, lr {lr:.2e}")

    step, epoch = 0, 0
    meter = defaultdict(float)
    t_start = time.time()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for image1, image2, flow, valid in loader:
            image1 = image1.to(device, non_blocking=True)
            image2 = image2.to(device, non_blocking=True)
            flow = flow.to(device, non_blocking=True)
            valid = valid.to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                flow_predictions = model(image1, image2, iters=args.iters)
            loss, epe = sequence_loss([p.float() for p in flow_predictions], flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            meter["loss"] += loss.item()
            meter["epe"] += epe.item()
            if step % 100 == 0:
                vals = torch.tensor([meter["loss"], meter["epe"]], device=device) / 100.0
                dist.all_reduce(vals)
                vals /= world
                if rank == 0:
                    print(f"step {step:6d} lr {scheduler.get_last_lr()[0]:.2e} loss {vals[0]:.4f} "
                          f"epe {vals[1]:.3f} ({(time.time() - t_start) / step:.2f}s/it)", flush=True)
                meter.clear()

            if step % args.val_every == 0 or step == args.num_steps:
                res = validate_sintel(model.module, 32, device, rank, world)
                if rank == 0:
                    print(f"step {step}: sintel clean {res['clean']:.3f} final {res['final']:.3f}", flush=True)
                    torch.save(model.module.state_dict(), os.path.join(out_dir, f"{step:06d}.pth"))
                dist.barrier()

            if step >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(out_dir, f"{args.exp}.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
