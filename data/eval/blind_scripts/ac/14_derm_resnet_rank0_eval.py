"""Skin-lesion classifier (ResNet-50, 8 classes) on the dermoscopy archive.

Kubernetes Indexed Job (completions=2, parallelism=2, completionMode: Indexed)
plus a headless Service "derm" so pod 0 resolves as derm-train-0.derm. One pod
per node with 4 GPUs:

    command: ["/bin/sh", "-c"]
    args:
      - torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$(JOB_COMPLETION_INDEX)
          --master_addr=derm-train-0.derm --master_port=29500
          /src/train_derm.py --data /datasets/derm/v4 --out /runs/derm-r50
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms.v2 as T
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from torchvision.models import ResNet50_Weights, resnet50

logger = logging.getLogger("derm")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--img", type=int, default=384)
    p.add_argument("--val-every", type=int, default=1)
    return p.parse_args()


def make_transforms(size):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = T.Compose([
        T.RandomResizedCrop(size, scale=(0.4, 1.0)), T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
        T.RandomRotation(45), T.ColorJitter(0.2, 0.2, 0.2, 0.05), T.ToImage(),
        T.ToDtype(torch.float32, scale=True), norm,
    ])
    val = T.Compose([T.Resize(size), T.CenterCrop(size), T.ToImage(),
                     T.ToDtype(torch.float32, scale=True), norm])
    return train, val


def class_weights(ds, n_cls):
    counts = np.bincount(ds.targets, minlength=n_cls).astype(np.float64)
    w = counts.sum() / (n_cls * np.maximum(counts, 1))
    return torch.tensor(w, dtype=torch.float32)


@torch.no_grad()
def run_validation(model, loader, device, n_cls):
    model.eval()
    probs, ys = [], []
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        probs.append(logits.float().softmax(1).cpu())
        ys.append(y)
    probs = torch.cat(probs).numpy()
    ys = torch.cat(ys).numpy()
    bacc = balanced_accuracy_score(ys, probs.argmax(1))
    auc = roc_auc_score(ys, probs, multi_class="ovr", labels=list(range(n_cls)))
    model.train()
    return bacc, auc


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_tf, val_tf = make_transforms(args.img)
    train_ds = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), val_tf)
    n_cls = len(train_ds.classes)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    # the full validation set is scored in one process so that AUC is exact
    val_dl = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=8, pin_memory=True)

    model = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
    model.fc = nn.Linear(model.fc.in_features, n_cls)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss(weight=class_weights(train_ds, n_cls).to(device), label_smoothing=0.05)
    lr = args.lr * world * args.bs / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    total = len(train_dl) * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.1)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "last.pt")
    start, best_auc = 0, 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best_auc = ck["epoch"] + 1, ck["best_auc"]
        logger.info("resumed from epoch %d", start)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        seen = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            loss = criterion(out.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            seen += torch.stack([loss.detach(), torch.ones((), device=device)])
            if i % 50 == 0:
                logger.info("ep %d it %d/%d loss %.4f", epoch, i, len(train_dl), loss.item())
        dist.all_reduce(seen)
        logger.info("ep %d mean loss %.4f (%.0fs)", epoch, (seen[0] / seen[1]).item(), time.time() - t0)

        if rank == 0 and (epoch + 1) % args.val_every == 0:
            bacc, auc = run_validation(model, val_dl, device, n_cls)
            logger.info("ep %d val balanced_acc %.4f macro_auc %.4f", epoch, bacc, auc)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best_auc": best_auc},
                       ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
