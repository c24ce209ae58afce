"""Product attribute recognition from several labelled catalogues.

Each source dataset labels a different attribute (category, colour, material,
pattern). The sets are concatenated and shuffled together, so one batch holds
samples from several tasks; every head runs on the whole batch and each loss
is masked to the samples that carry its label.

Launch (2 nodes x 8 GPUs):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29500 04_product_attributes_mixed.py \
        --root /mnt/shared/catalog --out /mnt/shared/runs/attr_mt
"""
import argparse
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

TASKS = ["category", "colour", "material", "pattern"]


class AttributeCSV(Dataset):
    """<root>/<task>/{train,val}.csv with columns path,label (label is an int id)."""

    def __init__(self, root, task, split, tf):
        self.root = os.path.join(root, task)
        self.df = pd.read_csv(os.path.join(self.root, f"{split}.csv"))
        self.task_id = TASKS.index(task)
        self.tf = tf

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = Image.open(os.path.join(self.root, "images", row.path)).convert("RGB")
        return self.tf(img), int(row.label), self.task_id


class AttributeNet(nn.Module):
    def __init__(self, backbone, n_classes):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, num_classes=0)
        d = self.backbone.num_features
        self.heads = nn.ModuleList([nn.Linear(d, n_classes[t]) for t in TASKS])

    def forward(self, x):
        f = self.backbone(x)
        return [h(f) for h in self.heads]


def masked_losses(logits, labels, task_ids, smoothing):
    losses = []
    for k, lg in enumerate(logits):
        m = task_ids == k
        # sum / count keeps the graph through every head even when a task is absent
        l = F.cross_entropy(lg[m], labels[m], reduction="sum", label_smoothing=smoothing)
        losses.append(l / m.sum().clamp(min=1))
    return losses


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--backbone", default="convnext_small.fb_in22k")
    p.add_argument("--n_classes", default="48,17,12,9")
    p.add_argument("--task_weights", default="1.0,0.7,0.7,0.5")
    p.add_argument("--img", type=int, default=224)
    p.add_argument("--bs", type=int, default=48)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def evaluate(model, val_loaders, device):
    model.eval()
    acc = {}
    with torch.no_grad():
        for k, t in enumerate(TASKS):
            correct, total = 0, 0
            for x, y, _ in val_loaders[t]:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(x)[k].argmax(1)
                correct += (pred == y).sum().item()
                total += y.numel()
            acc[t] = correct / max(total, 1)
    model.train()
    return acc


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    n_classes = dict(zip(TASKS, map(int, args.n_classes.split(","))))
    weights = [float(w) for w in args.task_weights.split(",")]

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(int(args.img * 1.14)),
        transforms.CenterCrop(args.img),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    train_ds = ConcatDataset([AttributeCSV(args.root, t, "train", train_tf) for t in TASKS])
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loaders = {}
    for t in TASKS:
        vds = AttributeCSV(args.root, t, "val", val_tf)
        val_loaders[t] = DataLoader(vds, batch_size=128,
                                    sampler=DistributedSampler(vds, shuffle=False),
                                    num_workers=args.workers, pin_memory=True)

    model = AttributeNet(args.backbone, n_classes).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x, y, tid) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y, tid = y.to(device, non_blocking=True), tid.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            losses = masked_losses([l.float() for l in logits], y, tid, args.smoothing)
            loss = sum(w * l for w, l in zip(weights, losses))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}:{it}/{len(train_loader)}] loss {loss.item():.4f} "
                      + " ".join(f"{t}={l.item():.3f}" for t, l in zip(TASKS, losses)), flush=True)

        acc = evaluate(model.module, val_loaders, device)
        mean_acc = sum(acc.values()) / len(acc)
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s val {acc} mean {mean_acc:.4f}", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "acc": acc}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if mean_acc > best:
                best = mean_acc
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
