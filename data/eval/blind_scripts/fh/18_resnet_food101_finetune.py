#!/usr/bin/env python
"""Fine-tune an ImageNet ResNet-152 on Food-101.

    #SBATCH --account=ml-users
    #SBATCH --partition=gpu
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=8
    #SBATCH --time=10:00:00

    master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_ADDR=$master MASTER_PORT=29650
    srun python food101_finetune.py --data /shared/datasets/food-101 \
        --pretrained /shared/models/resnet152_imagenet.pth --out /shared/users/$USER/food101
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from torchvision.datasets import Food101

log = logging.getLogger("food101")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.01, help="per 256 images")
    return parser.parse_args()


def setup():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s r{rank} %(levelname)s %(message)s")
    if rank != 0:
        log.setLevel(logging.WARNING)
    return rank, world_size, local_rank


def build_model(path, num_classes):
    net = models.resnet152()
    net.load_state_dict(torch.load(path, map_location="cpu"))
    net.fc = nn.Linear(net.fc.in_features, num_classes)
    nn.init.zeros_(net.fc.bias)
    nn.init.normal_(net.fc.weight, std=0.01)
    return net


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    loss_sum = torch.zeros(1, device=device)
    crit = nn.CrossEntropyLoss(reduction="sum")
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        loss_sum += crit(logits, labels)
        correct += (logits.argmax(1) == labels).sum()
        count += labels.numel()
    for t in (correct, count, loss_sum):
        dist.all_reduce(t)
    return (correct / count).item(), (loss_sum / count).item()


def main():
    args = get_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.TrivialAugmentWide(), transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), normalize])
    train_set = Food101(args.data, split="train", transform=train_tf, download=False)
    test_set = Food101(args.data, split="test", transform=test_tf, download=False)

    sampler = DistributedSampler(train_set, shuffle=True)
    workers = int(os.environ.get("SLURM_CPUS_PER_TASK", 8))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=100, shuffle=False, num_workers=workers,
                             pin_memory=True)

    model = build_model(args.pretrained, 101).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    start_epoch, best_acc = 0, 0.0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        log.info("resumed from epoch %d", ckpt["epoch"])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())
        scheduler.step()
        log.info("epoch %d train time %.0fs", epoch, time.time() - t0)

        if rank == 0:
            acc, val_loss = evaluate(model.module, test_loader, device)
            log.info("epoch %d test acc %.4f loss %.4f", epoch, acc, val_loss)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch,
                     "best_acc": max(best_acc, acc)}
            torch.save(state, ckpt_path)
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
