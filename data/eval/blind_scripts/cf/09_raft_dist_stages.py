"""Distributed RAFT trainer (stage-wise, as in the paper), ported from the DataParallel train.py.

    torchrun --standalone --nproc_per_node=4 train_dist.py --stage sintel \
        --restore_ckpt checkpoints/raft-things.pth --batch_size 8 --lr 1.25e-4 --image_size 368 768 --wdecay 1e-5 --gamma 0.85
"""
from __future__ import print_function

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import core.datasets as datasets
from core.raft import RAFT
from core.utils.utils import InputPadder

MAX_FLOW = 400
SUM_FREQ = 100
VAL_FREQ = 5000


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8, max_flow=MAX_FLOW):
    n_predictions = len(flow_preds)
    flow_loss = 0.0
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        i_loss = (flow_preds[i] - flow_gt).abs()
        flow_loss += i_weight * (valid[:, None] * i_loss).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()
    epe = epe.view(-1)[valid.view(-1)]
    return flow_loss, epe


def fetch_dataset(args):
    if args.stage == "chairs":
        aug = {"crop_size": args.image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
        return datasets.FlyingChairs(aug, split="training")
    if args.stage == "things":
        aug = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        return datasets.FlyingThings3D(aug, dstype="frames_cleanpass") + \
            datasets.FlyingThings3D(aug, dstype="frames_finalpass")
    if args.stage == "sintel":
        aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
        things = datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
        sintel_clean = datasets.MpiSintel(aug, split="training", dstype="clean")
        sintel_final = datasets.MpiSintel(aug, split="training", dstype="final")
        kitti = datasets.KITTI({"crop_size": args.image_size, "min_scale": -0.3, "max_scale": 0.5, "do_flip": True})
        hd1k = datasets.HD1K({"crop_size": args.image_size, "min_scale": -0.5, "max_scale": 0.2, "do_flip": True})
        return 100 * sintel_clean + 100 * sintel_final + 200 * kitti + 5 * hd1k + things
    if args.stage == "kitti":
        aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False}
        return datasets.KITTI(aug, split="training")
    raise ValueError(args.stage)


@torch.no_grad()
def validate_sintel(model, iters, device, rank, world):
    model.eval()
    results = {}
    for dstype in ["clean", "final"]:
        val_dataset = datasets.MpiSintel(split="training", dstype=dstype)
        acc = torch.zeros(5, device=device, dtype=torch.float64)
        for val_id in range(rank, len(val_dataset), world):
            image1, image2, flow_gt, _ = val_dataset[val_id]
            image1 = image1[None].to(device)
            image2 = image2[None].to(device)
            padder = InputPadder(image1.shape)
            image1, image2 = padder.pad(image1, image2)
            _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
            flow = padder.unpad(flow_pr[0])
            epe = torch.sum((flow - flow_gt.to(device)) ** 2, dim=0).sqrt().view(-1)
            acc += torch.stack([epe.sum(), (epe < 1).sum(), (epe < 3).sum(), (epe < 5).sum(),
                                torch.tensor(epe.numel(), device=device)]).double()
        dist.all_reduce(acc)
        n = acc[4].item()
        results[dstype] = acc[0].item() / n
        if rank == 0:
            print("Validation (%s) EPE: %.3f, 1px: %.3f, 3px: %.3f, 5px: %.3f" % (
                dstype, acc[0].item() / n, acc[1].item() / n, acc[2].item() / n, acc[3].item() / n))
    return results


class Logger:
    def __init__(self, name, scheduler):
        self.scheduler = scheduler
        self.writer = SummaryWriter(os.path.join("runs", name))

    def push(self, step, stats):
        lr = self.scheduler.get_last_lr()[0]
        print("[{:6d}, {:10.7f}] ".format(step, lr) + ", ".join("{}: {:.4f}".format(k, v) for k, v in stats.items()))
        for k, v in stats.items():
            self.writer.add_scalar(k, v, step)

    def close(self):
        self.writer.close()


def train(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = RAFT(args)
    if args.restore_ckpt is not None:
        ckpt = torch.load(args.restore_ckpt, map_location="cpu")
        model.load_state_dict({k.replace("module.", "", 1): v for k, v in ckpt.items()}, strict=False)
    if args.stage == "chairs":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = nn.parallel.DistributedDataParallel(model.to(device), device_ids=[local_rank])
    if rank == 0:
        print("Parameter Count: %d" % sum(p.numel() for p in model.parameters() if p.requires_grad))

    model.train()
    if args.stage != "chairs":
        model.freeze_bn()

    train_dataset = fetch_dataset(args)
    sampler = DistributedSampler(train_dataset, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size // world, sampler=sampler,
                              pin_memory=True, num_workers=4, drop_last=True)
    if rank == 0:
        print("Training with %d image pairs" % len(train_dataset))

    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=args.epsilon)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100,
                                              pct_start=0.05, cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    logger = Logger(args.name, scheduler) if rank == 0 else None

    total_steps, epoch = 0, 0
    stats = torch.zeros(2, device=device)
    should_keep_training = True
    while should_keep_training:
        sampler.set_epoch(epoch)
        for data_blob in train_loader:
            optimizer.zero_grad()
            image1, image2, flow, valid = [x.to(device, non_blocking=True) for x in data_blob]
            if args.add_noise:
                stdv = np.random.uniform(0.0, 5.0)
                image1 = (image1 + stdv * torch.randn(*image1.shape, device=device)).clamp(0.0, 255.0)
                image2 = (image2 + stdv * torch.randn(*image2.shape, device=device)).clamp(0.0, 255.0)

            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                flow_predictions = model(image1, image2, iters=args.iters)
            loss, epe = sequence_loss(flow_predictions, flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            stats += torch.stack([loss.detach(), epe.mean().detach()])
            total_steps += 1
            if total_steps % SUM_FREQ == 0:
                dist.all_reduce(stats)
                stats /= SUM_FREQ * world
                if rank == 0:
                    logger.push(total_steps, {"loss": stats[0].item(), "epe": stats[1].item()})
                stats.zero_()

            if total_steps % VAL_FREQ == 0:
                results = {}
                if args.stage in ("sintel", "things", "chairs"):
                    results = validate_sintel(model.module, args.iters * 2, device, rank, world)
                if rank == 0:
                    torch.save(model.module.state_dict(), "checkpoints/%d_%s.pth" % (total_steps, args.name))
                    for k, v in results.items():
                        logger.writer.add_scalar("val/" + k, v, total_steps)
                model.train()
                if args.stage != "chairs":
                    model.module.freeze_bn()
                dist.barrier()

            if total_steps >= args.num_steps:
                should_keep_training = False
                break
        epoch += 1

    if rank == 0:
        logger.close()
        torch.save(model.module.state_dict(), "checkpoints/%s.pth" % args.name)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft", help="name your experiment")
    parser.add_argument("--stage", help="determines which dataset to use for training")
    parser.add_argument("--restore_ckpt", help="restore checkpoint")
    parser.add_argument("--small", action="store_true", help="use small model")
    parser.add_argument("--lr", type=float, default=0.00002)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--image_size", type=int, nargs="+", default=[384, 512])
    parser.add_argument("--mixed_precision", action="store_true", help="use mixed precision")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=0.00005)
    parser.add_argument("--epsilon", type=float, default=1e-8)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--gamma", type=float, default=0.8, help="exponential weighting")
    parser.add_argument("--add_noise", action="store_true")
    parser.add_argument("--alternate_corr", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(1234)
    np.random.seed(1234)
    os.makedirs("checkpoints", exist_ok=True)
    train(args)
