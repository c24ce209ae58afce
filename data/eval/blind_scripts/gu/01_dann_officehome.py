"""DANN (Ganin & Lempitsky) on Office-Home, multi-GPU with DistributedDataParallel.

The first few epochs are source-only so the classifier is reasonable before the
adversarial game starts; after that the domain discriminator is switched on.

    torchrun --nproc_per_node=4 01_dann_officehome.py --root data/office-home -s Ar -t Cl
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

DOMAINS = {"Ar": "Art", "Cl": "Clipart", "Pr": "Product", "Rw": "Real_World"}


def get_args():
    p = argparse.ArgumentParser("DANN Office-Home")
    p.add_argument("--root", default="data/office-home")
    p.add_argument("-s", "--source", default="Ar", choices=list(DOMAINS))
    p.add_argument("-t", "--target", default="Cl", choices=list(DOMAINS))
    p.add_argument("--batch-size", type=int, default=32, help="per GPU, per domain")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--iters-per-epoch", type=int, default=500)
    p.add_argument("--trade-off", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/dann_officehome")
    p.add_argument("--print-freq", type=int, default=100)
    return p.parse_args()


class ImageList(Dataset):
    def __init__(self, root, list_file, transform):
        self.root = root
        self.transform = transform
        with open(list_file) as f:
            rows = [line.split() for line in f if line.strip()]
        self.samples = [(r[0], int(r[1])) for r in rows]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), label


class InfiniteLoader:
    """Cycles over a loader forever, bumping the sampler epoch each pass."""

    def __init__(self, loader):
        self.loader = loader
        self.epoch = 0
        self._it = None

    def _reset(self):
        if isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(self.epoch)
        self._it = iter(self.loader)

    def __next__(self):
        if self._it is None:
            self._reset()
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self._reset()
            return next(self._it)


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.neg() * ctx.coeff, None


class DANN(nn.Module):
    def __init__(self, num_classes, bottleneck_dim=256, hidden=1024):
        super().__init__()
        resnet = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1)
        resnet.fc = nn.Identity()
        self.backbone = resnet
        self.bottleneck = nn.Sequential(
            nn.Linear(2048, bottleneck_dim), nn.BatchNorm1d(bottleneck_dim), nn.ReLU()
        )
        self.head = nn.Linear(bottleneck_dim, num_classes)
        self.discriminator = nn.Sequential(
            nn.Linear(bottleneck_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, x, grl_coeff=None):
        feat = self.bottleneck(self.backbone(x))
        logits = self.head(feat)
        if grl_coeff is None:
            return logits, None
        dom = self.discriminator(GradReverse.apply(feat, grl_coeff))
        return logits, dom


def build_loaders(args, world_size, rank):
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize,
    ])
    test_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize,
    ])
    lists = os.path.join(args.root, "image_list")
    src = ImageList(args.root, os.path.join(lists, f"{DOMAINS[args.source]}.txt"), train_tf)
    tgt = ImageList(args.root, os.path.join(lists, f"{DOMAINS[args.target]}.txt"), train_tf)
    tgt_test = ImageList(args.root, os.path.join(lists, f"{DOMAINS[args.target]}.txt"), test_tf)

    def mk(ds, shuffle, drop_last):
        sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank,
                                     shuffle=shuffle, seed=args.seed)
        return DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=drop_last)

    return mk(src, True, True), mk(tgt, True, True), mk(tgt_test, False, False)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        logits, _ = model(images)
        correct += (logits.argmax(1) == labels).sum()
        total += labels.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return (correct / total).item() * 100.0


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    src_loader, tgt_loader, test_loader = build_loaders(args, world_size, rank)
    num_classes = 65

    model = DANN(num_classes).to(device)
    params = [
        {"params": model.backbone.parameters(), "lr_mult": 0.1},
        {"params": model.bottleneck.parameters(), "lr_mult": 1.0},
        {"params": model.head.parameters(), "lr_mult": 1.0},
        {"params": model.discriminator.parameters(), "lr_mult": 1.0},
    ]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum,
                                weight_decay=args.wd, nesterov=True)
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    src_iter, tgt_iter = InfiniteLoader(src_loader), InfiniteLoader(tgt_loader)
    total_iters = args.epochs * args.iters_per_epoch
    best_acc = 0.0
    step = 0
    for epoch in range(args.epochs):
        model.train()
        adapt = epoch >= args.warmup_epochs
        t0 = time.time()
        for it in range(args.iters_per_epoch):
            progress = step / total_iters
            lr_factor = (1 + 10 * progress) ** (-0.75)
            for g in optimizer.param_groups:
                g["lr"] = args.lr * g["lr_mult"] * lr_factor

            xs, ys = next(src_iter)
            xt, _ = next(tgt_iter)
            xs, ys = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            xt = xt.to(device, non_blocking=True)

            if adapt:
                coeff = 2.0 / (1.0 + math.exp(-10 * progress)) - 1.0
                logits, dom = model(torch.cat([xs, xt]), grl_coeff=coeff)
                logits_s = logits[: xs.size(0)]
                dom_labels = torch.cat([
                    torch.ones(xs.size(0), 1, device=device),
                    torch.zeros(xt.size(0), 1, device=device),
                ])
                cls_loss = F.cross_entropy(logits_s, ys)
                dom_loss = F.binary_cross_entropy_with_logits(dom, dom_labels)
                loss = cls_loss + args.trade_off * dom_loss
            else:
                logits_s, _ = model(xs)
                cls_loss = F.cross_entropy(logits_s, ys)
                dom_loss = torch.zeros((), device=device)
                loss = cls_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1

            if it % args.print_freq == 0:
                stats = torch.stack([cls_loss.detach(), dom_loss.detach()])
                dist.all_reduce(stats)
                stats /= world_size
                if rank == 0:
                    print(f"ep {epoch} it {it}/{args.iters_per_epoch} "
                          f"cls {stats[0]:.4f} dom {stats[1]:.4f} "
                          f"lr {optimizer.param_groups[1]['lr']:.5f} "
                          f"{time.time() - t0:.1f}s", flush=True)

        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: target acc {acc:.2f}", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "acc": acc}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best target acc {best_acc:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
