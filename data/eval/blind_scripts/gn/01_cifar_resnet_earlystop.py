#!/usr/bin/env python
"""ResNet-18 on CIFAR-10 with step-based validation, plateau LR and early stopping.

    torchrun --standalone --nproc_per_node=4 01_cifar_resnet_earlystop.py --data-dir /data/cifar10
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, Subset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

logger = logging.getLogger("cifar")

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--out-dir", default="./runs/cifar_r18")
    p.add_argument("--batch-size", type=int, default=128, help="per-GPU batch size")
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 128, scaled linearly")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--max-steps", type=int, default=40000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--patience", type=int, default=8)
    p.add_argument("--val-size", type=int, default=5000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ShardSampler(Sampler):
    """Every rank gets a strided slice of the eval set, without padding."""

    def __init__(self, n, rank, world_size):
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def build_model(num_classes=10):
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_datasets(args, is_main):
    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(MEAN, STD),
    ])
    eval_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])

    if is_main:
        torchvision.datasets.CIFAR10(args.data_dir, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data_dir, train=False, download=True)
    dist.barrier()

    full_train = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
    full_eval = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=eval_tf)
    test_set = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=eval_tf)

    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(full_train), generator=g).tolist()
    val_idx, train_idx = perm[: args.val_size], perm[args.val_size:]
    return Subset(full_train, train_idx), Subset(full_eval, val_idx), test_set


@torch.no_grad()
def evaluate(model, loader, metrics, device):
    model.eval()
    metrics.reset()
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = model(images)
        metrics.update(logits, targets)
    model.train()


def save_checkpoint(path, model, optimizer, scheduler, step, best_acc):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "best_acc": best_acc,
    }, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    torch.manual_seed(args.seed)
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_set, val_set, test_set = build_datasets(args, is_main)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=ShardSampler(len(val_set), rank, world_size),
                            num_workers=args.workers, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=ShardSampler(len(test_set), rank, world_size),
                             num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.2, patience=2)
    metrics = MetricCollection({
        "acc": MulticlassAccuracy(num_classes=10),
        "f1": MulticlassF1Score(num_classes=10, average="macro"),
    }).to(device)

    best_path = os.path.join(args.out_dir, "best.pt")
    best_acc, bad_evals = 0.0, 0
    step, epoch = 0, 0
    stop = False
    t0 = time.time()

    while not stop and step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for images, targets in train_loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)

            loss = F.cross_entropy(model(images), targets, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1

            if step % 100 == 0 and is_main:
                logger.info("step %d epoch %d loss %.4f lr %.4g (%.1fs)", step, epoch, loss.item(),
                            optimizer.param_groups[0]["lr"], time.time() - t0)

            if step % args.eval_every == 0:
                evaluate(model.module, val_loader, metrics, device)
                decision = torch.zeros(2, device=device)
                if is_main:
                    results = {k: v.item() for k, v in metrics.compute().items()}
                    logger.info("eval step %d: acc %.4f macro-f1 %.4f", step, results["acc"], results["f1"])
                    if results["acc"] > best_acc:
                        best_acc = results["acc"]
                        bad_evals = 0
                        save_checkpoint(best_path, model, optimizer, scheduler, step, best_acc)
                        logger.info("new best %.4f, saved to %s", best_acc, best_path)
                    else:
                        bad_evals += 1
                    decision[0] = results["acc"]
                    decision[1] = float(bad_evals >= args.patience)
                dist.broadcast(decision, src=0)
                scheduler.step(decision[0].item())
                if decision[1].item() > 0:
                    logger.info("no improvement for %d evaluations, stopping", args.patience)
                    stop = True
                    break

            if step >= args.max_steps:
                break
        epoch += 1

    dist.barrier()
    ckpt = torch.load(best_path, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    evaluate(model.module, test_loader, metrics, device)
    test_results = {k: v.item() for k, v in metrics.compute().items()}
    if is_main:
        logger.info("best checkpoint from step %d, test: %s", ckpt["step"], test_results)
        with open(os.path.join(args.out_dir, "test_metrics.json"), "w") as f:
            json.dump({"step": ckpt["step"], **test_results}, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
