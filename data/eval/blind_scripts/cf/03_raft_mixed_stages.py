#!/usr/bin/env python
# RAFT staged training (chairs -> things -> sintel/kitti mix) on multiple GPUs.
#
#   torchrun --nnodes=1 --nproc_per_node=4 train_stages.py --stage sintel \
#       --restore_ckpt checkpoints/raft-things.pth --batch_size 8 --lr 0.000125 --num_steps 100000
import argparse
import json
import logging
import os
import os.path as osp
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from core import datasets
from core.raft import RAFT
from core.utils.utils import InputPadder

logger = logging.getLogger("raft")

STAGE_DEFAULTS = {
    "chairs": dict(image_size=[368, 496], gamma=0.8, wdecay=1e-4),
    "things": dict(image_size=[400, 720], gamma=0.8, wdecay=1e-4),
    "sintel": dict(image_size=[368, 768], gamma=0.85, wdecay=1e-5),
    "kitti": dict(image_size=[288, 960], gamma=0.85, wdecay=1e-5),
}


def build_train_set(stage, image_size):
    if stage == "chairs":
        aug = {"crop_size": image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
        return datasets.FlyingChairs(aug, split="training")
    if stage == "things":
        aug = {"crop_size": image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        clean = datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
        final = datasets.FlyingThings3D(aug, dstype="frames_finalpass")
        return ConcatDataset([clean, final])
    if stage == "sintel":
        aug = {"crop_size": image_size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
        things = datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
        sintel_clean = datasets.MpiSintel(aug, split="training", dstype="clean")
        sintel_final = datasets.MpiSintel(aug, split="training", dstype="final")
        kitti = datasets.KITTI({"crop_size": image_size, "min_scale": -0.3, "max_scale": 0.5, "do_flip": True})
        hd1k = datasets.HD1K({"crop_size": image_size, "min_scale": -0.5, "max_scale": 0.2, "do_flip": True})
        # same mixing ratios as the paper: 100x sintel, 200x kitti, 5x hd1k
        return ConcatDataset([sintel_clean] * 100 + [sintel_final] * 100 + [kitti] * 200 + [hd1k] * 5 + [things])
    if stage == "kitti":
        aug = {"crop_size": image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False}
        return datasets.KITTI(aug, split="training")
    raise ValueError(stage)


def sequence_loss(flow_preds, flow_gt, valid, gamma, max_flow=400):
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    n = len(flow_preds)
    loss = 0.0
    for i, pred in enumerate(flow_preds):
        w = gamma ** (n - i - 1)
        loss = loss + w * (valid[:, None] * (pred - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()[valid]
    return loss, epe.detach()


@torch.no_grad()
def validate_sintel(net, device, rank, world, iters=32):
    net.eval()
    out = {}
    for dstype in ["clean", "final"]:
        ds = datasets.MpiSintel(split="training", dstype=dstype)
        shard = Subset(ds, list(range(rank, len(ds), world)))
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        for img1, img2, flow_gt, _ in shard:
            img1, img2 = img1[None].to(device), img2[None].to(device)
            padder = InputPadder(img1.shape)
            img1, img2 = padder.pad(img1, img2)
            _, flow_pr = net(img1, img2, iters=iters, test_mode=True)
            flow = padder.unpad(flow_pr[0])
            epe = torch.sum((flow - flow_gt.to(device)) ** 2, dim=0).sqrt()
            acc[0] += epe.sum()
            acc[1] += epe.numel()
        dist.all_reduce(acc)
        out["sintel_" + dstype] = (acc[0] / acc[1]).item()
    net.train()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="raft")
    p.add_argument("--stage", required=True, choices=list(STAGE_DEFAULTS))
    p.add_argument("--restore_ckpt", default=None)
    p.add_argument("--small", action="store_true")
    p.add_argument("--lr", type=float, default=0.00025)
    p.add_argument("--num_steps", type=int, default=100000)
    p.add_argument("--batch_size", type=int, default=8, help="total over all GPUs")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--mixed_precision", action="store_true")
    p.add_argument("--alternate_corr", action="store_true")
    p.add_argument("--out", default="checkpoints")
    p.add_argument("--val_freq", type=int, default=5000)
    args = p.parse_args()
    for k, v in STAGE_DEFAULTS[args.stage].items():
        setattr(args, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    if args.batch_size % world != 0:
        raise ValueError(f"batch_size {args.batch_size} not divisible by world size {world}")
    bs = args.batch_size // world

    model = RAFT(args)
    if args.restore_ckpt:
        sd = torch.load(args.restore_ckpt, map_location="cpu")
        sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        logger.info("restored %s (missing=%d unexpected=%d)", args.restore_ckpt, len(missing), len(unexpected))
    if args.stage == "chairs":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    model.train()
    if args.stage != "chairs":
        # BatchNorm statistics are kept from chairs pretraining
        model.module.freeze_bn()

    train_set = build_train_set(args.stage, args.image_size)
    logger.info("training with %d image pairs, %d per GPU", len(train_set), bs)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=bs, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(osp.join("runs", args.name))
        with open(osp.join(args.out, args.name + "_args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    step, epoch = 0, 0
    stats = torch.zeros(3, device=device)
    tic = time.time()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for image1, image2, flow, valid in loader:
            image1, image2 = image1.to(device, non_blocking=True), image2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            if args.stage != "chairs":
                stdv = np.random.uniform(0.0, 5.0)
                image1 = (image1 + stdv * torch.randn_like(image1)).clamp(0.0, 255.0)
                image2 = (image2 + stdv * torch.randn_like(image2)).clamp(0.0, 255.0)

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(image1, image2, iters=args.iters)
            loss, epe = sequence_loss(preds, flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            stats[0] += loss.detach()
            stats[1] += epe.sum()
            stats[2] += epe.numel()
            step += 1

            if step % 100 == 0:
                dist.all_reduce(stats)
                if rank == 0:
                    loss_avg = stats[0].item() / (100 * world)
                    epe_avg = stats[1].item() / max(stats[2].item(), 1.0)
                    logger.info("step %d lr %.2e loss %.4f epe %.3f (%.2fs/it)", step,
                                scheduler.get_last_lr()[0], loss_avg, epe_avg, (time.time() - tic) / 100)
                    writer.add_scalar("train/loss", loss_avg, step)
                    writer.add_scalar("train/epe", epe_avg, step)
                stats.zero_()
                tic = time.time()

            if step % args.val_freq == 0:
                if args.stage in ("sintel", "things"):
                    res = validate_sintel(model.module, device, rank, world)
                    if rank == 0:
                        logger.info("val %s", res)
                        for k, v in res.items():
                            writer.add_scalar("val/" + k, v, step)
                    if args.stage != "chairs":
                        model.module.freeze_bn()
                if rank == 0:
                    torch.save(model.module.state_dict(), osp.join(args.out, f"{step}_{args.name}.pth"))
                dist.barrier()

            if step >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), osp.join(args.out, f"{args.name}.pth"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
