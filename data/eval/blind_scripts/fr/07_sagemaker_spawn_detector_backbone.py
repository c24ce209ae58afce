"""SageMaker entry point: fine-tunes a ConvNeXt-T backbone on the retail-shelf crops.

Launched from the notebook with the plain PyTorch estimator (no `distribution=`),
so SageMaker runs this script once per instance and we fan out to the GPUs ourselves:

    PyTorch(entry_point="train.py", source_dir="src", role=role,
            instance_type="ml.p4d.24xlarge", instance_count=2,
            framework_version="2.1", py_version="py310",
            checkpoint_s3_uri="s3://shelf-ml/ckpt/convnext-t",
            hyperparameters={"epochs": 30, "batch-size": 64})
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

CHECKPOINT_DIR = "/opt/ml/checkpoints"  # synced to checkpoint_s3_uri by SageMaker


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--master-port", type=int, default=29500)
    # SageMaker environment
    parser.add_argument("--hosts", type=str, default=os.environ.get("SM_HOSTS", '["algo-1"]'))
    parser.add_argument("--current-host", type=str, default=os.environ.get("SM_CURRENT_HOST", "algo-1"))
    parser.add_argument("--num-gpus", type=int, default=int(os.environ.get("SM_NUM_GPUS", 1)))
    parser.add_argument("--train-dir", type=str, default=os.environ.get("SM_CHANNEL_TRAIN"))
    parser.add_argument("--val-dir", type=str, default=os.environ.get("SM_CHANNEL_VAL"))
    parser.add_argument("--model-dir", type=str, default=os.environ.get("SM_MODEL_DIR", "/opt/ml/model"))
    return parser.parse_args()


def build_data(args, rank, world_size):
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(236),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train_set = datasets.ImageFolder(args.train_dir, train_tf)
    val_set = datasets.ImageFolder(args.val_dir, val_tf)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_part = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_part, batch_size=128, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, sampler, len(train_set.classes)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        counts[0] += (model(x).argmax(1) == y).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def worker(local_rank, args):
    hosts = json.loads(args.hosts)
    node_rank = hosts.index(args.current_host)
    world_size = len(hosts) * args.num_gpus
    rank = node_rank * args.num_gpus + local_rank

    os.environ["MASTER_ADDR"] = hosts[0]
    os.environ["MASTER_PORT"] = str(args.master_port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", local_rank)

    train_loader, val_loader, sampler, n_cls = build_data(args, rank, world_size)

    model = models.convnext_tiny(weights=models.ConvNeXt_Tiny_Weights.IMAGENET1K_V1)
    model.classifier[2] = nn.Linear(model.classifier[2].in_features, n_cls)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, pct_start=0.1,
                                                total_steps=args.epochs * len(train_loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    # SageMaker restores checkpoint_s3_uri into /opt/ml/checkpoints on every instance
    start_epoch, best = 0, 0.0
    ckpt_file = os.path.join(CHECKPOINT_DIR, "last.pt")
    if os.path.exists(ckpt_file):
        state = torch.load(ckpt_file, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["sched"])
        start_epoch, best = state["epoch"] + 1, state["best"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            if rank == 0 and i % 50 == 0:
                print(f"epoch={epoch} iter={i} loss={loss.item():.4f}", flush=True)

        acc = evaluate(model, val_loader, device)
        if rank == 0:
            # SageMaker metric regex: "val_acc=([0-9\.]+)"
            print(f"epoch={epoch} val_acc={acc:.4f} epoch_time={time.time() - tic:.1f}", flush=True)
            best = max(best, acc)
            os.makedirs(CHECKPOINT_DIR, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best},
                       os.path.join(CHECKPOINT_DIR, "last.tmp"))
            os.replace(os.path.join(CHECKPOINT_DIR, "last.tmp"), ckpt_file)
        dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.model_dir, "model.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.num_gpus, join=True)
