"""
ResNet-18 on CIFAR-10, multi-GPU version of my Colab notebook.

Launch:
    torchrun --nproc_per_node=4 01_cifar_resnet_ddp.py --epochs 40
"""
import argparse
import json
import os
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from tqdm import tqdm


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR-10 ResNet-18 DDP")
    parser.add_argument("--data-dir", type=str, default="./data")
    parser.add_argument("--out-dir", type=str, default="./runs/resnet18_cifar")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=128, help="batch size per GPU")
    parser.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 256")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_model(num_classes=10):
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    # CIFAR images are 32x32, so use a 3x3 stem and drop the maxpool
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def get_datasets(data_dir, rank):
    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])

    # only rank 0 downloads, the others wait for it
    if rank != 0:
        dist.barrier()
    train_set = torchvision.datasets.CIFAR10(data_dir, train=True, download=(rank == 0), transform=train_tf)
    test_set = torchvision.datasets.CIFAR10(data_dir, train=False, download=(rank == 0), transform=test_tf)
    if rank == 0:
        dist.barrier()
    return train_set, test_set


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        logits = model(images)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
        total += labels.size(0)
    return loss_sum / total, correct / total


def plot_history(history, out_dir):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(history["train_loss"], label="train")
    axes[0].plot(history["val_loss"], label="val")
    axes[0].set_title("loss")
    axes[0].legend()
    axes[1].plot(history["val_acc"], label="val acc")
    axes[1].set_title("accuracy")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=120)
    plt.close(fig)


def main():
    args = get_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.backends.cudnn.benchmark = True

    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world_size={world_size}, per-gpu batch={args.batch_size}")

    train_set, test_set = get_datasets(args.data_dir, rank)

    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=True,
        drop_last=True,
    )
    # evaluation is cheap on CIFAR, rank 0 does it on the full test set
    test_loader = DataLoader(test_set, batch_size=512, shuffle=False,
                             num_workers=args.num_workers, pin_memory=True)

    model = build_model().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    global_batch = args.batch_size * world_size
    lr = args.base_lr * global_batch / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, epochs=args.epochs, steps_per_epoch=len(train_loader), pct_start=0.15
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    scaler = torch.cuda.amp.GradScaler()

    history = {"train_loss": [], "val_loss": [], "val_acc": []}
    best_acc = 0.0

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)  # loss sum, n samples

        pbar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not is_main)
        for images, labels in pbar:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                outputs = model(images)
                loss = criterion(outputs, labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            running[0] += loss.detach() * labels.size(0)
            running[1] += labels.size(0)
            pbar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.4f}")

        dist.all_reduce(running, op=dist.ReduceOp.SUM)
        train_loss = (running[0] / running[1]).item()

        if is_main:
            val_loss, val_acc = evaluate(model.module, test_loader, device)
            history["train_loss"].append(train_loss)
            history["val_loss"].append(val_loss)
            history["val_acc"].append(val_acc)
            print(f"epoch {epoch + 1}: train_loss={train_loss:.4f} val_loss={val_loss:.4f} "
                  f"val_acc={val_acc:.4f} ({time.time() - t0:.1f}s)")

            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best.pt"))
                print(f"  new best acc {best_acc:.4f}, saved")
        dist.barrier()

    if is_main:
        torch.save(model.module.state_dict(), os.path.join(args.out_dir, "last.pt"))
        plot_history(history, args.out_dir)
        with open(os.path.join(args.out_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
        print(f"done, best val acc {best_acc:.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
