"""RAFT-small pre-training on FlyingChairs, distributed version of train.py.

    torchrun --nproc_per_node=4 11_raft_small_chairs.py --name raft-small-chairs --small \
        --stage chairs --validation chairs --batch_size 8 --lr 0.0004 --num_steps 100000
"""
from __future__ import print_function, division

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.append("core")

from raft import RAFT  # noqa: E402
import datasets  # noqa: E402
from utils.utils import InputPadder  # noqa: E402

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
    metrics = torch.stack([epe.mean(), (epe < 1).float().mean(), (epe < 3).float().mean(), (epe < 5).float().mean()])
    return flow_loss, metrics


@torch.no_grad()
def validate_chairs(model, device, rank, world_size, iters=24):
    """Chairs validation split, sharded across ranks."""
    model.eval()
    val_dataset = datasets.FlyingChairs(split="validation")
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for val_id in range(rank, len(val_dataset), world_size):
        image1, image2, flow_gt, _ = val_dataset[val_id]
        image1 = image1[None].to(device)
        image2 = image2[None].to(device)
        _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
        epe = torch.sum((flow_pr[0].cpu() - flow_gt) ** 2, dim=0).sqrt()
        acc[0] += epe.sum().item()
        acc[1] += epe.numel()
    dist.all_reduce(acc)
    model.train()
    return {"chairs": (acc[0] / acc[1]).item()}


class Logger:
    def __init__(self, scheduler, name):
        self.scheduler = scheduler
        self.total_steps = 0
        self.running = None
        self.writer = SummaryWriter(os.path.join("runs", name))

    def push(self, metrics):
        self.total_steps += 1
        self.running = metrics if self.running is None else self.running + metrics
        if self.total_steps % SUM_FREQ == 0:
            avg = (self.running / SUM_FREQ).tolist()
            print("[{:6d}, {:10.7f}] epe {:.4f} 1px {:.4f} 3px {:.4f} 5px {:.4f}".format(
                self.total_steps, self.scheduler.get_last_lr()[0], *avg), flush=True)
            for k, v in zip(["epe", "1px", "3px", "5px"], avg):
                self.writer.add_scalar(k, v, self.total_steps)
            self.running = None

    def write_dict(self, results):
        for k, v in results.items():
            self.writer.add_scalar(k, v, self.total_steps)


def train(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    model = RAFT(args)
    if args.restore_ckpt is not None:
        sd = torch.load(args.restore_ckpt, map_location="cpu")
        model.load_state_dict({k.replace("module.", "", 1): v for k, v in sd.items()}, strict=False)
    model.to(device)
    model.train()
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    if rank == 0:
        print("Parameter Count: %d" % sum(p.numel() for p in model.parameters() if p.requires_grad))

    aug_params = {"crop_size": args.image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
    train_dataset = datasets.FlyingChairs(aug_params, split="training")
    sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size // world_size, sampler=sampler,
                              pin_memory=True, num_workers=4, drop_last=True)

    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=args.epsilon)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                              cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    logger = Logger(scheduler, args.name) if rank == 0 else None

    total_steps = 0
    epoch = 0
    keep_training = True
    while keep_training:
        sampler.set_epoch(epoch)
        for data_blob in train_loader:
            optimizer.zero_grad()
            image1, image2, flow, valid = [x.to(device, non_blocking=True) for x in data_blob]

            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                flow_predictions = model(image1, image2, iters=args.iters)
            loss, metrics = sequence_loss(flow_predictions, flow, valid, args.gamma)

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            metrics = metrics.detach()
            dist.all_reduce(metrics)
            metrics /= world_size
            if logger is not None:
                logger.push(metrics.cpu())

            total_steps += 1
            if total_steps % VAL_FREQ == 0:
                results = validate_chairs(model.module, device, rank, world_size)
                if rank == 0:
                    torch.save(model.module.state_dict(), "checkpoints/%d_%s.pth" % (total_steps, args.name))
                    logger.write_dict(results)
                    print("validation:", results, flush=True)

            if total_steps >= args.num_steps:
                keep_training = False
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), "checkpoints/%s.pth" % args.name)
        logger.writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft", help="name your experiment")
    parser.add_argument("--stage", default="chairs")
    parser.add_argument("--restore_ckpt", help="restore checkpoint")
    parser.add_argument("--small", action="store_true", help="use small model")
    parser.add_argument("--validation", type=str, nargs="+")
    parser.add_argument("--local_rank", type=int, default=0)

    parser.add_argument("--lr", type=float, default=0.0004)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--image_size", type=int, nargs="+", default=[368, 496])
    parser.add_argument("--mixed_precision", action="store_true", help="use mixed precision")
    parser.add_argument("--alternate_corr", action="store_true")

    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=0.0001)
    parser.add_argument("--epsilon", type=float, default=1e-8)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--gamma", type=float, default=0.8, help="exponential weighting")
    args = parser.parse_args()

    torch.manual_seed(1234)
    np.random.seed(1234)
    os.makedirs("checkpoints", exist_ok=True)

    train(args)
