"""Short-budget architecture trials on a down-sampled ImageNet proxy.

The proxy (a class-balanced fraction of ImageNet at 64x64) is decoded once and
cached as a .npz next to the dataset; every candidate architecture in the
candidates file is then trained for a few epochs on it and ranked.

    torchrun --standalone --nproc_per_node=8 20_proxy_cache_arch_trials.py \
        --imagenet /datasets/imagenet --cache-dir /datasets/cache --candidates cands.json
"""
import argparse
import json
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def build_proxy(root, split, per_class, size, seed=0):
    folder = ImageFolder(os.path.join(root, split))
    by_class = defaultdict(list)
    for path, label in folder.samples:
        by_class[label].append(path)
    rng = np.random.default_rng(seed)
    paths, labels = [], []
    for label in sorted(by_class):
        files = sorted(by_class[label])
        take = rng.choice(len(files), size=min(per_class, len(files)), replace=False)
        paths += [files[i] for i in sorted(take)]
        labels += [label] * len(take)
    images = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    for i, p in enumerate(paths):
        with Image.open(p) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = min(w, h)
            im = im.crop(((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)).resize((size, size), Image.BICUBIC)
            images[i] = np.asarray(im)
    return images, np.asarray(labels, dtype=np.int64)


def load_proxy(args, split, per_class):
    cache = os.path.join(args.cache_dir, f"imagenet_{split}_{per_class}pc_{args.size}px.npz")
    if not os.path.exists(cache):
        os.makedirs(args.cache_dir, exist_ok=True)
        images, labels = build_proxy(args.imagenet, split, per_class, args.size)
        np.savez(cache, images=images, labels=labels)
    data = np.load(cache)
    return data["images"], data["labels"]


class ArrayDataset(Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.from_numpy(self.images[i]).permute(2, 0, 1), int(self.labels[i])


def gpu_augment(x, train):
    x = x.float().div_(255)
    if train:
        n = x.size(0)
        pad = F.pad(x, (4, 4, 4, 4), mode="reflect")
        i, j = np.random.randint(0, 9, size=2)
        x = pad[:, :, i:i + x.size(2), j:j + x.size(3)]
        flip = torch.rand(n, device=x.device) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
    return (x - MEAN.to(x.device)) / STD.to(x.device)


class CandidateNet(nn.Module):
    """cand = {"widths": [...], "depths": [...], "kernel": k, "se": bool}"""

    def __init__(self, cand, num_classes=1000):
        super().__init__()
        layers, cin = [nn.Conv2d(3, cand["widths"][0], 3, 1, 1, bias=False), nn.BatchNorm2d(cand["widths"][0]), nn.ReLU(inplace=True)], cand["widths"][0]
        k = cand["kernel"]
        for stage, (w, d) in enumerate(zip(cand["widths"], cand["depths"])):
            for i in range(d):
                stride = 2 if i == 0 and stage > 0 else 1
                layers += [nn.Conv2d(cin, w, k, stride, k // 2, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
                if cand.get("se"):
                    layers.append(SqueezeExcite(w))
                cin = w
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class SqueezeExcite(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // r, 1), nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(F.relu(self.fc1(s))))


def run_candidate(cand, args, loaders, device, local_rank):
    train_loader, val_loader, sampler = loaders
    model = DDP(CandidateNet(cand).to(device).to(memory_format=torch.channels_last), device_ids=[local_rank])
    lr = args.lr * args.bs * dist.get_world_size() / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=args.epochs * len(train_loader), pct_start=0.2)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x = gpu_augment(x.to(device, non_blocking=True), True).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    hits = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in val_loader:
            x = gpu_augment(x.to(device, non_blocking=True), False).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hits[0] += (model(x).argmax(1) == y).sum()
            hits[1] += y.numel()
    dist.all_reduce(hits)
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt, sched
    torch.cuda.empty_cache()
    return (hits[0] / hits[1]).item(), n_params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--imagenet", default="/datasets/imagenet")
    ap.add_argument("--cache-dir", default="/datasets/cache")
    ap.add_argument("--candidates", required=True)
    ap.add_argument("--out", default="trials/proxy64")
    ap.add_argument("--train-per-class", type=int, default=128)
    ap.add_argument("--val-per-class", type=int, default=50)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--bs", type=int, default=256, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tr_x, tr_y = load_proxy(args, "train", args.train_per_class)
    va_x, va_y = load_proxy(args, "val", args.val_per_class)
    train_set = ArrayDataset(tr_x, tr_y)
    val_idx = np.arange(rank, len(va_y), world)
    val_set = ArrayDataset(va_x[val_idx], va_y[val_idx])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 500, num_workers=2, pin_memory=True)

    with open(args.candidates) as f:
        candidates = json.load(f)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    results = []
    for idx, cand in enumerate(candidates):
        t0 = time.time()
        acc, n_params = run_candidate(cand, args, (train_loader, val_loader, sampler), device, local_rank)
        results.append({"idx": idx, "cand": cand, "proxy_top1": acc, "params": n_params, "secs": round(time.time() - t0)})
        if rank == 0:
            print(f"[{idx + 1}/{len(candidates)}] top1 {acc:.4f} params {n_params / 1e6:.2f}M {cand}", flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(sorted(results, key=lambda r: -r["proxy_top1"]), f, indent=1)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
