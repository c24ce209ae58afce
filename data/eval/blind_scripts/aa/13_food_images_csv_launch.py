"""Food-101-style classifier from a CSV manifest (path,label), ConvNeXt-Tiny.

    python -m torch.distributed.launch --nproc_per_node=4 --use_env 13_food_images_csv_launch.py \
        --manifest data/food/manifest.csv --img-root data/food/images --output-dir outputs/food_convnext
"""
import argparse
import os
import shutil
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


def get_parser():
    parser = argparse.ArgumentParser("food classifier")
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--img-root", required=True)
    parser.add_argument("--output-dir", default="outputs/food_convnext")
    parser.add_argument("--epochs", default=24, type=int)
    parser.add_argument("--batch-size", default=64, type=int)
    parser.add_argument("--lr", default=4e-4, type=float)
    parser.add_argument("--weight-decay", default=0.05, type=float)
    parser.add_argument("--workers", default=8, type=int)
    parser.add_argument("--print-freq", default=50, type=int)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return parser


class ManifestDataset(Dataset):
    def __init__(self, df, img_root, class_to_idx, transform):
        self.paths = df["path"].tolist()
        self.targets = [class_to_idx[c] for c in df["label"]]
        self.root = img_root
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        img = Image.open(os.path.join(self.root, self.paths[idx])).convert("RGB")
        return self.transform(img), self.targets[idx]


def read_manifest(path, img_root):
    df = pd.read_csv(path)
    df["label"] = df["label"].str.strip().str.lower().str.replace(" ", "_")
    exists = df["path"].map(lambda p: os.path.isfile(os.path.join(img_root, p)))
    df = df[exists].drop_duplicates("path").reset_index(drop=True)
    return df


def save_checkpoint(state, is_best, output_dir):
    path = os.path.join(output_dir, "checkpoint.pth")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(output_dir, "model_best.pth"))


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def validate(model, loader, device):
    model.eval()
    correct = torch.zeros(2, device=device)
    with torch.no_grad():
        for images, target in loader:
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                output = model(images)
            top5 = output.topk(5, 1).indices
            correct[0] += (top5[:, 0] == target).sum()
            correct[1] += (top5 == target[:, None]).any(1).sum()
    n = torch.tensor(len(loader.sampler), device=device, dtype=torch.float)
    dist.all_reduce(correct)
    dist.all_reduce(n)
    return (correct[0] / n).item() * 100, (correct[1] / n).item() * 100


def main(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    device = torch.device("cuda", args.local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True

    df = read_manifest(args.manifest, args.img_root)
    classes = sorted(df["label"].unique())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    train_df, val_df = train_test_split(df, test_size=0.1, stratify=df["label"], random_state=0)
    if rank == 0:
        print(f"{len(classes)} classes | train {len(train_df)} | val {len(val_df)}", flush=True)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.TrivialAugmentWide(), transforms.ToTensor(), normalize,
                                   transforms.RandomErasing(p=0.1)])
    val_tf = transforms.Compose([transforms.Resize(236), transforms.CenterCrop(224), transforms.ToTensor(), normalize])
    train_set = ManifestDataset(train_df, args.img_root, class_to_idx, train_tf)
    val_set = ManifestDataset(val_df, args.img_root, class_to_idx, val_tf)
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = models.convnext_tiny(weights=models.ConvNeXt_Tiny_Weights.IMAGENET1K_V1)
    model.classifier[2] = nn.Linear(model.classifier[2].in_features, len(classes))
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank])

    lr = args.lr * args.batch_size * world_size / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    os.makedirs(args.output_dir, exist_ok=True)
    start_epoch, best_acc1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        losses, end = AverageMeter(), time.time()
        for i, (images, target) in enumerate(train_loader):
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.update(loss.item(), images.size(0))
            if i % args.print_freq == 0 and rank == 0:
                print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {losses.avg:.4f} "
                      f"{(time.time() - end) / (i + 1):.3f}s/it", flush=True)

        acc1, acc5 = validate(model, val_loader, device)
        if rank == 0:
            print(f" * Epoch {epoch} Acc@1 {acc1:.3f} Acc@5 {acc5:.3f}", flush=True)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        save_checkpoint({
            "epoch": epoch + 1,
            "state_dict": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "best_acc1": best_acc1,
            "classes": classes,
        }, is_best, args.output_dir)

    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_parser().parse_args())
