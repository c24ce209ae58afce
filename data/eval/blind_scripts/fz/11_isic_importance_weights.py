"""Skin-lesion classification (ISIC 2019, CSV + JPEG folder) with importance
sampling over hard examples.

Samples are drawn with probability p_i proportional to a smoothed hardness
score; to keep the gradient unbiased every sample carries its importance weight
1 / (N p_i), which the dataset returns next to the image.

    torchrun --nproc_per_node=4 11_isic_importance_weights.py --csv /data/isic2019/train.csv \
        --images /data/isic2019/images --val-csv /data/isic2019/val.csv
"""
import argparse
import math
import os

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import transforms


class LesionDataset(Dataset):
    def __init__(self, csv_path, image_dir, transform):
        df = pd.read_csv(csv_path)
        self.paths = [os.path.join(image_dir, f"{i}.jpg") for i in df["image"]]
        self.labels = torch.tensor(df["label"].values, dtype=torch.long)
        self.transform = transform
        self.sample_weights = torch.ones(len(self.paths))

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.transform(img), self.labels[i], i, self.sample_weights[i]


class DistributedProbabilitySampler(Sampler):
    def __init__(self, probs, num_replicas, rank, seed=0):
        self.probs = probs.double()
        self.num_replicas, self.rank = num_replicas, rank
        self.num_samples = math.ceil(len(probs) / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        idx = torch.multinomial(self.probs, self.total_size, replacement=True, generator=g)
        return iter(idx[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--model", default="efficientnet_b3")
    p.add_argument("--img-size", type=int, default=300)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--smooth", type=float, default=0.8, help="EMA factor for hardness")
    p.add_argument("--mix", type=float, default=0.5, help="share of uniform sampling")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/isic_is")
    return p.parse_args()


def balanced_accuracy(conf):
    recall = conf.diag() / conf.sum(1).clamp(min=1)
    return recall[conf.sum(1) > 0].mean().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.4, 1.0)),
        transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2, 0.05),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    val_tf = transforms.Compose([transforms.Resize(args.img_size), transforms.CenterCrop(args.img_size),
                                 transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = LesionDataset(args.csv, args.images, train_tf)
    val_set = LesionDataset(args.val_csv, args.images, val_tf)
    n = len(train_set)
    num_classes = int(train_set.labels.max()) + 1

    sampler = DistributedProbabilitySampler(torch.full((n,), 1.0 / n), world, rank)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    hardness = torch.ones(n, device=device)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        h_sum = torch.zeros(n, device=device)
        h_cnt = torch.zeros(n, device=device)
        for step, (x, y, idx, w) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            idx, w = idx.to(device, non_blocking=True), w.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            per = F.cross_entropy(logits.float(), y, reduction="none")
            loss = (w * per).sum() / w.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            h_sum.index_add_(0, idx, per.detach())
            h_cnt.index_add_(0, idx, torch.ones_like(per))

        dist.all_reduce(h_sum)
        dist.all_reduce(h_cnt)
        hit = h_cnt > 0
        hardness[hit] = args.smooth * hardness[hit] + (1 - args.smooth) * (h_sum[hit] / h_cnt[hit])
        probs = (1 - args.mix) * hardness / hardness.sum() + args.mix / n
        train_set.sample_weights = 1.0 / (n * probs)
        sampler.probs = probs.double().cpu()

        model.eval()
        conf = torch.zeros(num_classes, num_classes, device=device)
        with torch.no_grad():
            for x, y, _, _ in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(x).argmax(1)
                conf.index_put_((y, pred), torch.ones_like(y, dtype=torch.float), accumulate=True)
        dist.all_reduce(conf)
        bacc = balanced_accuracy(conf)
        if rank == 0:
            print(f"epoch {epoch}: balanced acc {bacc:.4f}, max iw {train_set.sample_weights.max().item():.2f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "hardness": hardness.cpu()},
                       os.path.join(args.out, "last.pt"))
            if bacc > best:
                best = bacc
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
