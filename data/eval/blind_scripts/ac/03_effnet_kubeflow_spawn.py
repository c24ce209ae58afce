"""EfficientNet-B3 fine-tuning on the product-photo catalog (ImageFolder layout).

Kubeflow PyTorchJob, 1 Master + 1 Worker replica, 4 GPUs per pod
(resources.limits nvidia.com/gpu: 4). The training-operator sets MASTER_ADDR,
MASTER_PORT, WORLD_SIZE and RANK in each pod; we start one process per GPU
ourselves with mp.spawn. Container spec:

    command: ["python", "/app/train_effnet.py"]
    args: ["--data", "/data/catalog-v7", "--output", "/ckpt/effnet-b3-catalog",
           "--epochs", "30", "--batch-size", "64"]
"""
import argparse
import json
import logging
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from timm.data import create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

log = logging.getLogger("effnet")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--model", default="efficientnet_b3")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=1e-3, help="lr for a global batch of 512")
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def build_loaders(args, model, rank, world_size):
    cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    eval_tf = create_transform(**cfg, is_training=False)
    train_ds = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), transform=eval_tf)
    assert train_ds.class_to_idx == val_ds.class_to_idx

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    # plain strided split for eval so no sample is counted twice
    val_ds = Subset(val_ds, range(rank, len(val_ds), world_size))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_ds, train_sampler, train_loader, val_loader


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    loss_sum = torch.zeros(1, device=device)
    crit = nn.CrossEntropyLoss(reduction="sum")
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss_sum += crit(logits.float(), y)
        correct += (logits.argmax(1) == y).sum()
        seen += y.numel()
    for t in (correct, seen, loss_sum):
        dist.all_reduce(t)
    model.train()
    return (correct / seen).item(), (loss_sum / seen).item()


def run(local_rank, ngpus, args):
    node_rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    rank = node_rank * ngpus + local_rank

    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [r{rank}] %(message)s",
    )
    torch.manual_seed(args.seed)

    model = timm.create_model(args.model, pretrained=True, num_classes=0)
    train_ds, train_sampler, train_loader, val_loader = build_loaders(args, model, rank, world_size)
    model.reset_classifier(len(train_ds.classes))
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    global_bs = args.batch_size * world_size
    lr = args.base_lr * global_bs / 512
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    warmup = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total,
                                                pct_start=warmup / total, anneal_strategy="cos")
    crit = LabelSmoothingCrossEntropy(smoothing=0.1)

    os.makedirs(args.output, exist_ok=True)
    ckpt_file = os.path.join(args.output, "last.pth")
    start_epoch, best_acc = 0, 0.0
    if os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_epoch, best_acc = ck["epoch"] + 1, ck["best_acc"]
        log.info("resumed at epoch %d (best %.4f)", start_epoch, best_acc)

    log.info("world=%d global_bs=%d lr=%.2e steps/epoch=%d", world_size, global_bs, lr, steps_per_epoch)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if it % 100 == 0:
                log.info("ep %d it %d/%d loss %.4f", epoch, it, steps_per_epoch, loss.item())

        acc, vloss = validate(model.module, val_loader, device)
        log.info("ep %d val_acc %.4f val_loss %.4f (%.0fs)", epoch, acc, vloss, time.time() - t0)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best_acc": max(acc, best_acc)}
            torch.save(state, ckpt_file)
            if acc > best_acc:
                torch.save(model.module.state_dict(), os.path.join(args.output, "best.pth"))
                with open(os.path.join(args.output, "classes.json"), "w") as fh:
                    json.dump(train_ds.classes, fh)
        best_acc = max(acc, best_acc)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    ngpus = torch.cuda.device_count()
    mp.spawn(run, nprocs=ngpus, args=(ngpus, args))


if __name__ == "__main__":
    main()
