"""Product-image classifier (EfficientNet-B0) on an in-house ImageFolder dump.

The dump has no validation split, so 10% of the images are held out for model
selection. Early stopping on validation accuracy, plateau LR schedule.

    torchrun --nproc_per_node=8 10_product_images_effnet.py --root /mnt/shared/products_2024 --epochs 40
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from torchvision.models import efficientnet_b0, EfficientNet_B0_Weights

log = logging.getLogger("products")


class WithTransform(Dataset):
    def __init__(self, subset, transform):
        self.subset, self.transform = subset, transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, label = self.subset[i]
        return self.transform(img), label


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="/mnt/shared/exp/products_effb0")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device, dtype=torch.long)
    total = torch.zeros(1, device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (model(x).argmax(1) == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return correct.item() / max(total.item(), 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    # different augmentation streams per rank
    seed_everything(args.seed + rank)

    weights = EfficientNet_B0_Weights.IMAGENET1K_V1
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2),
                          T.ToTensor(), T.Normalize(weights.transforms().mean, weights.transforms().std)])
    eval_tf = weights.transforms()

    full = ImageFolder(args.root)
    n_val = int(len(full) * args.val_frac)
    train_part, val_part = random_split(full, [len(full) - n_val, n_val])
    train_ds = WithTransform(train_part, train_tf)
    val_ds = WithTransform(val_part, eval_tf)
    log.info("%d classes, %d train / %d val images", len(full.classes), len(train_ds), len(val_ds))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=256, num_workers=args.workers, pin_memory=True)

    model = efficientnet_b0(weights=weights)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, len(full.classes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc, wait = 0.0, 0
    best_ckpt = os.path.join(args.out, "best.pt")

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach() * y.numel()
            loss_sum[1] += y.numel()
        dist.all_reduce(loss_sum)

        val_acc = accuracy(model.module, val_loader, device)
        scheduler.step(val_acc)
        log.info("epoch %d train_loss %.4f val_acc %.4f lr %.2e (%.0fs)", epoch,
                 (loss_sum[0] / loss_sum[1]).item(), val_acc, optimizer.param_groups[0]["lr"], time.time() - t0)

        if val_acc > best_acc:
            best_acc, wait = val_acc, 0
            if rank == 0:
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "classes": full.classes,
                            "val_acc": val_acc}, best_ckpt)
                log.info("saved new best (%.4f)", val_acc)
        else:
            wait += 1
            if wait >= args.patience:
                log.info("early stopping at epoch %d, best val_acc %.4f", epoch, best_acc)
                break

    dist.barrier()
    state = torch.load(best_ckpt, map_location=device)
    model.module.load_state_dict(state["model"])
    final_acc = accuracy(model.module, val_loader, device)
    log.info("reloaded best (epoch %d): val_acc %.4f", state["epoch"], final_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
