#!/usr/bin/env python3
"""Submit a ResNet-50 ImageNet run to Slurm through submitit.

    python 03_submitit_resnet.py --nodes 2 --gpus-per-node 8 --partition learnlab \
        --data /datasets01/imagenet_full_size/061417 --job-dir /checkpoint/$USER/r50

The job requeues itself on preemption / timeout and resumes from
<job-dir>/checkpoint.pth.
"""
import argparse
import os
import time
import uuid
from pathlib import Path

import submitit
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms


def get_parser():
    p = argparse.ArgumentParser("r50 submitit")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--partition", default="learnlab")
    p.add_argument("--timeout", type=int, default=72 * 60)
    p.add_argument("--job-dir", type=str, required=True)
    p.add_argument("--data", type=str, required=True)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for a total batch of 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--port", type=int, default=0)
    return p


def data_loaders(args, world, rank):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                            transforms.ToTensor(), normalize]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                            transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    # strided shard without padding, so every val image is counted exactly once
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)
    return train_dl, val_dl, train_sampler


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).argmax(1)
        correct[0] += (pred == y).sum()
        correct[1] += y.numel()
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


class Trainer(submitit.helpers.Checkpointable):
    def __init__(self, args):
        self.args = args

    def checkpoint(self, *args, **kwargs):
        # called by submitit on timeout / preemption; the training state is
        # already on disk, so just resubmit the same callable
        return submitit.helpers.DelayedSubmission(Trainer(self.args))

    def _setup(self):
        job_env = submitit.JobEnvironment()
        os.environ["MASTER_ADDR"] = job_env.hostnames[0]
        os.environ["MASTER_PORT"] = str(self.args.port)
        os.environ["RANK"] = str(job_env.global_rank)
        os.environ["LOCAL_RANK"] = str(job_env.local_rank)
        os.environ["WORLD_SIZE"] = str(job_env.num_tasks)
        torch.cuda.set_device(job_env.local_rank)
        dist.init_process_group(backend="nccl", init_method="env://")
        return job_env

    def __call__(self):
        args = self.args
        job_env = self._setup()
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", job_env.local_rank)
        torch.backends.cudnn.benchmark = True

        train_dl, val_dl, train_sampler = data_loaders(args, world, rank)

        model = torchvision.models.resnet50()
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device).to(memory_format=torch.channels_last)
        model = DDP(model, device_ids=[job_env.local_rank])

        lr = args.lr * args.batch_size * world / 256
        decay, no_decay = [], []
        for n, prm in model.named_parameters():
            (no_decay if prm.ndim <= 1 else decay).append(prm)
        opt = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=lr, momentum=0.9, nesterov=True)
        warmup = 5 * len(train_dl)
        total = args.epochs * len(train_dl)
        sched = torch.optim.lr_scheduler.SequentialLR(
            opt,
            [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warmup),
             torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup)],
            milestones=[warmup])
        scaler = torch.cuda.amp.GradScaler()
        criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

        ckpt = Path(args.job_dir) / "checkpoint.pth"
        start_epoch, best_acc = 0, 0.0
        if ckpt.exists():
            state = torch.load(ckpt, map_location=device)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            scaler.load_state_dict(state["scaler"])
            start_epoch, best_acc = state["epoch"] + 1, state["best_acc"]

        writer = SummaryWriter(os.path.join(args.job_dir, "tb")) if rank == 0 else None

        for epoch in range(start_epoch, args.epochs):
            train_sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for i, (x, y) in enumerate(train_dl):
                x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
                y = y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = criterion(model(x), y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                if writer is not None and i % 100 == 0:
                    step = epoch * len(train_dl) + i
                    writer.add_scalar("train/loss", loss.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

            acc = validate(model, val_dl, device)
            if rank == 0:
                best_acc = max(best_acc, acc)
                writer.add_scalar("val/top1", acc, epoch)
                print(f"epoch {epoch} top1 {acc:.4f} best {best_acc:.4f} time {time.time() - t0:.0f}s",
                      flush=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                            "epoch": epoch, "best_acc": best_acc}, str(ckpt) + ".tmp")
                os.replace(str(ckpt) + ".tmp", ckpt)
            dist.barrier()

        if writer is not None:
            writer.close()
        dist.destroy_process_group()
        return best_acc


def main():
    args = get_parser().parse_args()
    Path(args.job_dir).mkdir(parents=True, exist_ok=True)
    if args.port == 0:
        args.port = 20000 + uuid.uuid4().int % 20000

    executor = submitit.AutoExecutor(folder=os.path.join(args.job_dir, "%j"), slurm_max_num_timeout=20)
    executor.update_parameters(
        name="r50",
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=1,
        cpus_per_task=args.workers,
        mem_gb=40 * args.gpus_per_node,
        timeout_min=args.timeout,
        slurm_partition=args.partition,
        slurm_signal_delay_s=120,
    )
    job = executor.submit(Trainer(args))
    print(f"submitted job {job.job_id}, logs in {args.job_dir}/{job.job_id}")


if __name__ == "__main__":
    main()
