"""MDD: Margin Disparity Discrepancy (Zhang et al., ICML'19) on ImageCLEF-DA, DDP.

    torchrun --nproc_per_node=4 15_mdd_imageclef.py --root data/image_CLEF -s p -t i
"""
import argparse
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


class ImageList(Dataset):
    def __init__(self, root, domain, transform):
        with open(os.path.join(root, "list", f"{domain}List.txt")) as f:
            self.data = [(os.path.join(root, l.split()[0]), int(l.split()[1])) for l in f if l.strip()]
        self.transform = transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        p, y = self.data[i]
        return self.transform(Image.open(p).convert("RGB")), y


class GRL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.coeff * g, None


class MDDNet(nn.Module):
    def __init__(self, num_classes, bottleneck_dim=1024, width=1024):
        super().__init__()
        r = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1)
        r.fc = nn.Identity()
        self.backbone = r
        self.bottleneck = nn.Sequential(nn.Linear(2048, bottleneck_dim), nn.BatchNorm1d(bottleneck_dim),
                                        nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Sequential(nn.Linear(bottleneck_dim, width), nn.ReLU(), nn.Dropout(0.5),
                                  nn.Linear(width, num_classes))
        self.adv_head = nn.Sequential(nn.Linear(bottleneck_dim, width), nn.ReLU(), nn.Dropout(0.5),
                                      nn.Linear(width, num_classes))

    def forward(self, x, grl_coeff=1.0):
        f = self.bottleneck(self.backbone(x))
        y = self.head(f)
        y_adv = self.adv_head(GRL.apply(f, grl_coeff))
        return y, y_adv


def shift_log(x, offset=1e-6):
    return torch.log(torch.clamp(x + offset, max=1.0))


def mdd_loss(y_s, y_s_adv, y_t, y_t_adv, margin):
    pred_s = y_s.argmax(1).detach()
    pred_t = y_t.argmax(1).detach()
    source_disparity = F.cross_entropy(y_s_adv, pred_s)
    target_disparity = F.nll_loss(shift_log(1.0 - F.softmax(y_t_adv, dim=1)), pred_t)
    return -margin * source_disparity + target_disparity


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/image_CLEF")
    p.add_argument("-s", "--source", default="p")
    p.add_argument("-t", "--target", default="i")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.004)
    p.add_argument("--margin", type=float, default=4.0)
    p.add_argument("--trade-off", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--iters-per-epoch", type=int, default=500)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="checkpoints/mdd_clef")
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize(256), transforms.RandomResizedCrop(224),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    src = ImageList(args.root, args.source, train_tf)
    tgt = ImageList(args.root, args.target, train_tf)
    test = ImageList(args.root, args.target, test_tf)

    src_sampler = DistributedSampler(src, shuffle=True, drop_last=True)
    src_loader = DataLoader(src, args.batch_size, sampler=src_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    tgt_loader = DataLoader(tgt, args.batch_size, shuffle=True, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    test_loader = DataLoader(test, 64, sampler=DistributedSampler(test, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = MDDNet(num_classes=12).to(device)
    optimizer = torch.optim.SGD([
        {"params": model.backbone.parameters(), "lr": 0.1 * args.lr},
        {"params": model.bottleneck.parameters(), "lr": args.lr},
        {"params": model.head.parameters(), "lr": args.lr},
        {"params": model.adv_head.parameters(), "lr": args.lr},
    ], momentum=0.9, weight_decay=5e-4, nesterov=True)
    initial = [g["lr"] for g in optimizer.param_groups]
    model = DDP(model, device_ids=[local_rank])

    def batches(loader, sampler=None):
        ep = 0
        while True:
            if sampler is not None:
                sampler.set_epoch(ep)
            yield from loader
            ep += 1

    src_iter, tgt_iter = batches(src_loader, src_sampler), batches(tgt_loader)
    total = args.epochs * args.iters_per_epoch
    best = 0.0
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for i in range(args.iters_per_epoch):
            step = epoch * args.iters_per_epoch + i
            for g, lr0 in zip(optimizer.param_groups, initial):
                g["lr"] = lr0 * (1 + 0.0002 * step) ** -0.75
            coeff = 2.0 / (1.0 + np.exp(-10.0 * step / total)) - 1.0

            xs, ys = next(src_iter)
            xt, _ = next(tgt_iter)
            xs, ys, xt = xs.to(device), ys.to(device), xt.to(device)
            y, y_adv = model(torch.cat([xs, xt]), float(coeff))
            n = xs.size(0)
            cls_loss = F.cross_entropy(y[:n], ys)
            transfer_loss = -mdd_loss(y[:n], y_adv[:n], y[n:], y_adv[n:], args.margin)
            loss = cls_loss + args.trade_off * transfer_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([cls_loss.detach(), transfer_loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(meter)
        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, yb in test_loader:
                out, _ = model(x.to(device))
                hits[0] += (out.argmax(1) == yb.to(device)).sum()
                hits[1] += yb.numel()
        dist.all_reduce(hits)
        acc = (100 * hits[0] / hits[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: cls {meter[0] / meter[2]:.4f} transfer {meter[1] / meter[2]:.4f} "
                  f"target acc {acc:.2f} ({time.time() - tic:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.save, "best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best acc {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
