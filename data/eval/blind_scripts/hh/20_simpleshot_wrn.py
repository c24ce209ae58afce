#!/usr/bin/env python3
"""SimpleShot (Wang et al. 2019): train a WRN-28-10 classifier on the base classes, then
classify novel-class episodes by nearest centroid on centred + L2-normalised features (CL2N).

    torchrun --nproc_per_node=8 20_simpleshot_wrn.py --data /data/miniImageNet --arch wrn28_10 \
        --save-dir results/simpleshot_mini
"""
import argparse
import logging
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger("simpleshot")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/miniImageNet", help="ImageFolder dirs train/ val/ test/")
    ap.add_argument("--save-dir", default="results/simpleshot")
    ap.add_argument("--arch", default="wrn28_10")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    ap.add_argument("--label-smooth", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--test-episodes", type=int, default=10000, help="over all GPUs")
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


class WideBasic(nn.Module):
    def __init__(self, cin, cout, stride, drop=0.0):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop = drop
        self.short = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.relu(self.bn2(y))
        if self.drop > 0:
            y = F.dropout(y, self.drop, self.training)
        y = self.conv2(y)
        return y + (x if self.short is None else self.short(o))


class WideResNet(nn.Module):
    def __init__(self, depth=28, widen=10, num_classes=64, drop=0.0):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers, cin = [], widths[0]
        for i, (w, s) in enumerate(zip(widths[1:], (1, 2, 2))):
            for j in range(n):
                layers.append(WideBasic(cin, w, s if j == 0 else 1, drop))
                cin = w
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)
        self.feat_dim = cin

    def features(self, x):
        x = F.relu(self.bn(self.blocks(self.conv1(x))))
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def forward(self, x):
        return self.fc(self.features(x))


def build_model(arch, num_classes):
    depth, widen = {"wrn28_10": (28, 10), "wrn16_4": (16, 4)}[arch]
    return WideResNet(depth, widen, num_classes)


def image_tf(train):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return transforms.Compose([transforms.RandomResizedCrop(84), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    return transforms.Compose([transforms.Resize(96), transforms.CenterCrop(84), transforms.ToTensor(), norm])


@torch.no_grad()
def extract(model, loader, device):
    feats, labels = [], []
    for x, y in loader:
        feats.append(model.features(x.to(device, non_blocking=True)).float().cpu())
        labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def nearest_centroid_eval(novel_f, novel_y, base_mean, shot, n_episodes, rng, way=5, query=15):
    f = novel_f - base_mean
    f = f / f.norm(dim=1, keepdim=True)
    by_class = [torch.nonzero(novel_y == c).flatten() for c in novel_y.unique()]
    accs = []
    for _ in range(n_episodes):
        classes = rng.choice(len(by_class), way, replace=False)
        cent, qf, qy = [], [], []
        for j, c in enumerate(classes):
            idx = by_class[c][torch.from_numpy(rng.permutation(len(by_class[c]))[: shot + query])]
            cent.append(f[idx[:shot]].mean(0))
            qf.append(f[idx[shot:]])
            qy += [j] * query
        pred = torch.cdist(torch.cat(qf), torch.stack(cent)).argmin(1)
        accs.append((pred == torch.tensor(qy)).float().mean().item())
    return accs


def fewshot_evaluate(args, ckpt_path, num_classes, rank, world, device):
    """Reload the final checkpoint into a fresh network and run the CL2N nearest-centroid protocol."""
    model = build_model(args.arch, num_classes).to(device)
    ckpt = torch.load(ckpt_path, map_location=device)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    base = datasets.ImageFolder(os.path.join(args.data, "train"), image_tf(False))
    novel = datasets.ImageFolder(os.path.join(args.data, "test"), image_tf(False))
    mk = lambda ds: DataLoader(ds, batch_size=256, num_workers=args.workers, pin_memory=True)
    # every rank extracts the (small) feature sets itself; only the episodes are split
    base_f, _ = extract(model, mk(base), device)
    novel_f, novel_y = extract(model, mk(novel), device)
    base_mean = base_f.mean(0, keepdim=True)
    results = {}
    for shot in args.shots:
        rng = np.random.RandomState(args.seed * 100 + shot * 10 + rank)
        accs = torch.tensor(nearest_centroid_eval(novel_f, novel_y, base_mean, shot, args.test_episodes // world, rng),
                            device=device, dtype=torch.float64)
        s = torch.stack([accs.sum(), (accs ** 2).sum(), torch.tensor(float(accs.numel()), device=device,
                                                                       dtype=torch.float64)])
        dist.all_reduce(s)
        mean = s[0] / s[2]
        ci = 1.96 * torch.sqrt(s[1] / s[2] - mean ** 2) / torch.sqrt(s[2])
        results[shot] = (mean.item(), ci.item())
    return results


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), image_tf(True))
    num_classes = len(train_set.classes)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = DDP(build_model(args.arch, num_classes).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 60, 80], gamma=0.1)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smooth)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i % 200 == 0:
                log.info("epoch %d iter %d/%d loss %.4f", epoch, i, len(loader), loss.item())
        scheduler.step()

        if rank == 0:
            log.info("epoch %d done (%.0fs)", epoch, time.time() - t0)
            state = {"epoch": epoch + 1, "arch": args.arch, "state_dict": model.state_dict(),
                     "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.save_dir, "checkpoint.pth.tar"))
            if (epoch + 1) % 10 == 0:
                shutil.copyfile(os.path.join(args.save_dir, "checkpoint.pth.tar"),
                                os.path.join(args.save_dir, f"epoch_{epoch + 1:03d}.pth.tar"))
        dist.barrier()

    results = fewshot_evaluate(args, os.path.join(args.save_dir, "checkpoint.pth.tar"), num_classes,
                               rank, world, device)
    if rank == 0:
        for shot, (m, ci) in results.items():
            log.info("5-way %d-shot CL2N: %.2f +- %.2f", shot, 100 * m, 100 * ci)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
