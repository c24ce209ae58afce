"""RAFT training with DistributedDataParallel.

Follows the original chairs -> things -> sintel/kitti curriculum, but runs one
process per GPU (launched with torchrun) instead of nn.DataParallel.
"""
from __future__ import division, print_function

import argparse
import datetime
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.append("core")

import datasets  # noqa: E402
import evaluate  # noqa: E402
from raft import RAFT  # noqa: E402

from torch.cuda.amp import GradScaler  # noqa: E402

# exclude extremely large displacements
MAX_FLOW = 400
SUM_FREQ = 100
VAL_FREQ = 5000


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8, max_flow=MAX_FLOW):
    """Loss function defined over sequence of flow predictions."""
    n_predictions = len(flow_preds)
    flow_loss = 0.0

    # exclude invalid pixels and extremely large displacements
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)

    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        i_loss = (flow_preds[i] - flow_gt).abs()
        flow_loss += i_weight * (valid[:, None] * i_loss).mean()

    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()
    epe = epe.view(-1)[valid.view(-1)]

    metrics = {
        "epe": epe.mean(),
        "1px": (epe < 1).float().mean(),
        "3px": (epe < 3).float().mean(),
        "5px": (epe < 5).float().mean(),
    }
    return flow_loss, metrics


def reduce_metrics(metrics, world_size):
    keys = sorted(metrics.keys())
    values = torch.stack([metrics[k].detach().float() for k in keys])
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    values /= world_size
    return {k: v.item() for k, v in zip(keys, values)}


def fetch_dataset(args):
    """Create the training dataset for the current stage."""
    if args.stage == "chairs":
        aug_params = {"crop_size": args.image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
        train_dataset = datasets.FlyingChairs(aug_params, split="training")

    elif args.stage == "things":
        aug_params = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        clean_dataset = datasets.FlyingThings3D(aug_params, dstype="frames_cleanpass")
        final_dataset = datasets.FlyingThings3D(aug_params, dstype="frames_finalpass")
        train_dataset = clean_dataset + final_dataset

    elif args.stage == "sintel":
        aug_params = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
        things = datasets.FlyingThings3D(aug_params, dstype="frames_cleanpass")
        sintel_clean = datasets.MpiSintel(aug_params, split="training", dstype="clean")
        sintel_final = datasets.MpiSintel(aug_params, split="training", dstype="final")
        kitti = datasets.KITTI({"crop_size": args.image_size, "min_scale": -0.3, "max_scale": 0.5, "do_flip": True})
        hd1k = datasets.HD1K({"crop_size": args.image_size, "min_scale": -0.5, "max_scale": 0.2, "do_flip": True})
        train_dataset = 100 * sintel_clean + 100 * sintel_final + 200 * kitti + 5 * hd1k + things

    elif args.stage == "kitti":
        aug_params = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False}
        train_dataset = datasets.KITTI(aug_params, split="training")

    else:
        raise ValueError("unknown stage %s" % args.stage)

    return train_dataset


def fetch_optimizer(args, model):
    """Create the optimizer and learning rate scheduler."""
    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=args.epsilon)
    scheduler = optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, args.num_steps + 100,
        pct_start=0.05, cycle_momentum=False, anneal_strategy="linear")
    return optimizer, scheduler


class Logger:
    def __init__(self, scheduler, log_dir):
        self.scheduler = scheduler
        self.total_steps = 0
        self.running_loss = {}
        self.writer = SummaryWriter(log_dir=log_dir)

    def _print_training_status(self):
        metrics_data = [self.running_loss[k] / SUM_FREQ for k in sorted(self.running_loss.keys())]
        training_str = "[{:6d}, {:10.7f}] ".format(self.total_steps + 1, self.scheduler.get_last_lr()[0])
        metrics_str = ("{:10.4f}, " * len(metrics_data)).format(*metrics_data)
        print(training_str + metrics_str, flush=True)

        for k in self.running_loss:
            self.writer.add_scalar(k, self.running_loss[k] / SUM_FREQ, self.total_steps)
            self.running_loss[k] = 0.0

    def push(self, metrics):
        self.total_steps += 1
        for key in metrics:
            self.running_loss[key] = self.running_loss.get(key, 0.0) + metrics[key]
        if self.total_steps % SUM_FREQ == SUM_FREQ - 1:
            self._print_training_status()
            self.running_loss = {}

    def write_dict(self, results):
        for key in results:
            self.writer.add_scalar(key, results[key], self.total_steps)

    def close(self):
        self.writer.close()


def train(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    # validation runs on rank 0 while the other ranks wait, give it some room
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=60))
    device = torch.device("cuda", local_rank)

    assert args.batch_size % world_size == 0, "batch size must be divisible by the number of GPUs"
    per_gpu_batch = args.batch_size // world_size

    model = RAFT(args)
    if args.restore_ckpt is not None:
        state = torch.load(args.restore_ckpt, map_location="cpu")
        state = {(k[7:] if k.startswith("module.") else k): v for k, v in state.items()}
        model.load_state_dict(state, strict=False)
    if rank == 0:
        print("Parameter Count: %d" % sum(p.numel() for p in model.parameters() if p.requires_grad))

    model.to(device)
    model.train()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    if args.stage != "chairs":
        model.freeze_bn()

    train_dataset = fetch_dataset(args)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_dataset, batch_size=per_gpu_batch, sampler=train_sampler,
                              pin_memory=True, num_workers=args.workers, drop_last=True)
    if rank == 0:
        print("Training with %d image pairs, %d per GPU" % (len(train_dataset), per_gpu_batch))

    optimizer, scheduler = fetch_optimizer(args, model)
    scaler = GradScaler(enabled=args.mixed_precision)
    logger = Logger(scheduler, os.path.join("runs", args.name)) if rank == 0 else None

    total_steps = 0
    epoch = 0
    should_keep_training = True
    while should_keep_training:
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i_batch, data_blob in enumerate(train_loader):
            optimizer.zero_grad()
            image1, image2, flow, valid = [x.to(device, non_blocking=True) for x in data_blob]

            if args.add_noise:
                stdv = np.random.uniform(0.0, 5.0)
                image1 = (image1 + stdv * torch.randn(*image1.shape, device=device)).clamp(0.0, 255.0)
                image2 = (image2 + stdv * torch.randn(*image2.shape, device=device)).clamp(0.0, 255.0)

            flow_predictions = model(image1, image2, iters=args.iters)

            loss, metrics = sequence_loss(flow_predictions, flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)

            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            metrics = reduce_metrics(metrics, world_size)
            if logger is not None:
                logger.push(metrics)

            if total_steps % VAL_FREQ == VAL_FREQ - 1:
                if rank == 0:
                    PATH = "checkpoints/%d_%s.pth" % (total_steps + 1, args.name)
                    torch.save(model.module.state_dict(), PATH)

                    results = {}
                    for val_dataset in args.validation:
                        if val_dataset == "chairs":
                            results.update(evaluate.validate_chairs(model.module))
                        elif val_dataset == "sintel":
                            results.update(evaluate.validate_sintel(model.module))
                        elif val_dataset == "kitti":
                            results.update(evaluate.validate_kitti(model.module))
                    logger.write_dict(results)
                dist.barrier()

                model.train()
                if args.stage != "chairs":
                    model.freeze_bn()

            total_steps += 1
            if total_steps > args.num_steps:
                should_keep_training = False
                break

        if rank == 0:
            print("epoch %d done in %.1f min" % (epoch, (time.time() - t0) / 60.0), flush=True)
        epoch += 1

    if rank == 0:
        logger.close()
        PATH = "checkpoints/%s.pth" % args.name
        torch.save(model.module.state_dict(), PATH)
    dist.barrier()
    dist.destroy_process_group()
    return


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft", help="name your experiment")
    parser.add_argument("--stage", help="determines which dataset to use for training")
    parser.add_argument("--restore_ckpt", help="restore checkpoint")
    parser.add_argument("--small", action="store_true", help="use small model")
    parser.add_argument("--validation", type=str, nargs="+", default=[])

    parser.add_argument("--lr", type=float, default=0.00002)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=6, help="global batch size over all GPUs")
    parser.add_argument("--image_size", type=int, nargs="+", default=[384, 512])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mixed_precision", action="store_true", help="use mixed precision")

    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=0.00005)
    parser.add_argument("--epsilon", type=float, default=1e-8)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--gamma", type=float, default=0.8, help="exponential weighting")
    parser.add_argument("--add_noise", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(1234)
    np.random.seed(1234)

    os.makedirs("checkpoints", exist_ok=True)

    train(args)
