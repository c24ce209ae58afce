"""
Cats vs dogs (Kaggle dogs-vs-cats train.zip) with a torchvision ResNet-50,
split over my PC and my brother's PC.

Run one copy on each PC:
    my PC:       python catsdogs_ddp.py --rank 0 --world-size 2
    brother PC:  python catsdogs_ddp.py --rank 1 --world-size 2

Both PCs (Ubuntu 22.04) have the images in ~/ml/dogs-vs-cats/train.
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


class CatsDogs(Dataset):
    def __init__(self, files, transform):
        self.files = files
        self.transform = transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        path = self.files[idx]
        label = 0 if os.path.basename(path).startswith("cat") else 1
        img = Image.open(path).convert("RGB")
        return self.transform(img), label


def list_split(root, val_frac=0.1, seed=1234):
    files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".jpg"))
    rng = random.Random(seed)
    rng.shuffle(files)
    n_val = int(len(files) * val_frac)
    return files[n_val:], files[:n_val]


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def train_one_epoch(model, loader, optimizer, criterion, scaler, device, epoch, rank):
    model.train()
    total_loss = torch.zeros(1, device=device)
    n = 0
    start = time.time()
    for i, (x, y) in enumerate(loader):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        optimizer.zero_grad()
        with torch.cuda.amp.autocast():
            out = model(x)
            loss = criterion(out, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        total_loss += loss.detach()
        n += 1
        if rank == 0 and i % 50 == 0:
            print(f"  [{epoch}] {i}/{len(loader)} loss {loss.item():.4f} "
                  f"({(time.time() - start) / (i + 1):.2f}s/it)")
    dist.all_reduce(total_loss)
    return total_loss.item() / (n * dist.get_world_size())


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            pred = model(x).argmax(1)
        correct += (pred == y).sum()
        count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--data", default=os.path.expanduser("~/ml/dogs-vs-cats/train"))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ckpt", default="catsdogs_resnet50.pth")
    args = parser.parse_args()

    torch.cuda.set_device(args.gpu)
    setup(args.rank, args.world_size)
    device = torch.device("cuda", args.gpu)

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ])
    train_files, val_files = list_split(args.data)
    train_ds = CatsDogs(train_files, train_tf)
    val_ds = CatsDogs(val_files, val_tf)

    train_sampler = DistributedSampler(train_ds, num_replicas=args.world_size, rank=args.rank)
    val_sampler = DistributedSampler(val_ds, num_replicas=args.world_size, rank=args.rank,
                                     shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    model.fc = nn.Linear(model.fc.in_features, 2)
    model = model.to(device)
    model = DDP(model, device_ids=[args.gpu])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss()
    scaler = torch.cuda.amp.GradScaler()

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_loss = train_one_epoch(model, train_loader, optimizer, criterion, scaler,
                                     device, epoch, args.rank)
        acc = validate(model, val_loader, device)
        scheduler.step()
        if args.rank == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, val acc {acc:.4f}")
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), args.ckpt)
                print(f"saved {args.ckpt}")

    if args.rank == 0:
        print(f"best val acc: {best_acc:.4f}")
    cleanup()


if __name__ == "__main__":
    main()
