#!/usr/bin/env python3
# Balanced Softmax (Ren et al., NeurIPS 2020) for ImageNet-LT, ResNeXt-50, 8 GPUs.
#
#   torchrun --nproc_per_node=8 imagenetlt_balanced_softmax.py --cfg configs/bsce_rx50.yaml
#
# The yaml only overrides the keys in DEFAULT_CFG below.
import argparse
import copy
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms as T

DEFAULT_CFG = {
    "data": {"root": "/data/imagenet", "train_list": "data/ImageNet_LT_train.txt",
             "val_list": "data/ImageNet_LT_val.txt", "test_list": "data/ImageNet_LT_test.txt",
             "workers": 8},
    "train": {"epochs": 180, "batch_size": 64, "lr": 0.025, "ref_batch": 128, "wd": 5e-4,
              "warmup": 5},
    "out": "output/bsce_rx50",
}


def merge(a, b):
    out = copy.deepcopy(a)
    for k, v in (b or {}).items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and k in out else v
    return out


class TxtImageSet(Dataset):
    def __init__(self, root, txt, tf):
        self.root, self.tf = root, tf
        with open(txt) as f:
            self.items = [(p, int(c)) for p, c in (ln.split() for ln in f)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, c = self.items[i]
        return self.tf(Image.open(os.path.join(self.root, p)).convert("RGB")), c


class BalancedSoftmaxCE(nn.Module):
    """CE over logits + log n_c: the softmax is trained against the label prior."""

    def __init__(self, class_counts):
        super().__init__()
        self.register_buffer("log_n", torch.log(torch.as_tensor(class_counts, dtype=torch.float32).clamp(min=1)))

    def forward(self, logits, y):
        return F.cross_entropy(logits + self.log_n, y)


class EvalSampler(torch.utils.data.Sampler):
    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


@torch.no_grad()
def evaluate(model, loader, train_counts):
    model.eval()
    num_classes = len(train_counts)
    hit = torch.zeros(num_classes, dtype=torch.long)
    cnt = torch.zeros(num_classes, dtype=torch.long)
    for x, y in loader:
        logits = model(x.cuda(non_blocking=True))
        pred = logits.argmax(1).cpu()
        cnt += torch.bincount(y, minlength=num_classes)
        hit += torch.bincount(y[pred == y], minlength=num_classes)
    dist.all_reduce(hit)
    dist.all_reduce(cnt)
    acc = (hit.double() / cnt.clamp(min=1).double()).numpy()
    many, few = train_counts > 100, train_counts < 20
    return {
        "top1": 100.0 * hit.sum().item() / cnt.sum().item(),
        "many": 100.0 * acc[many].mean(),
        "medium": 100.0 * acc[~many & ~few].mean(),
        "few": 100.0 * acc[few].mean(),
    }


def lr_lambda(warmup_iters, total_iters):
    def f(it):
        if it < warmup_iters:
            return (it + 1) / warmup_iters
        return 0.5 * (1 + np.cos(np.pi * (it - warmup_iters) / (total_iters - warmup_iters)))
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    cfg = DEFAULT_CFG
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg = merge(DEFAULT_CFG, yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    tc, dc = cfg["train"], cfg["data"]

    normalize = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = TxtImageSet(dc["root"], dc["train_list"], T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ColorJitter(0.4, 0.4, 0.4), T.ToTensor(), normalize]))
    val_set = TxtImageSet(dc["root"], dc["val_list"], T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    train_counts = np.bincount([c for _, c in train_set.items], minlength=1000)

    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, tc["batch_size"], sampler=sampler, num_workers=dc["workers"],
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 100, sampler=EvalSampler(len(val_set), rank, world),
                            num_workers=dc["workers"], pin_memory=True)

    model = torchvision.models.resnext50_32x4d(num_classes=1000).cuda()
    model = DDP(model, device_ids=[local_rank])
    criterion = BalancedSoftmaxCE(train_counts).cuda()

    lr = tc["lr"] * tc["batch_size"] * world / tc["ref_batch"]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=tc["wd"])
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc["warmup"] * iters, tc["epochs"] * iters))

    start_epoch, best = 0, 0.0
    if cli.resume:
        ck = torch.load(cli.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best = ck["epoch"] + 1, ck.get("best", 0.0)

    for epoch in range(start_epoch, tc["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 200 == 0:
                print(f"[{epoch}][{i}/{iters}] loss={loss.item():.4f} lr={scheduler.get_last_lr()[0]:.5f}", flush=True)

        if (epoch + 1) % 5 == 0 or epoch + 1 == tc["epochs"]:
            r = evaluate(model.module, val_loader, train_counts)
            if rank == 0:
                print(f"epoch {epoch} ({time.time() - tic:.0f}s) val top1 {r['top1']:.2f} | "
                      f"many {r['many']:.2f} medium {r['medium']:.2f} few {r['few']:.2f}", flush=True)
                best = max(best, r["top1"])
                os.makedirs(cfg["out"], exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best, "cfg": cfg},
                           os.path.join(cfg["out"], "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
