"""Catalog image model: EfficientNet-B3 with a category head and a multi-label
attribute head.  DDP, fp16 AMP with gradient accumulation, preemption-safe.

    torchrun --nnodes=2 --nproc_per_node=8 --max-restarts=5 \
        --rdzv-backend=c10d --rdzv-endpoint=$MASTER:29400 \
        07_effnet_catalog_accum_preempt.py --out /mnt/efs/catalog/effb3_v7
"""
import argparse
import contextlib
import glob
import os
import signal
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

STOP_REQUESTED = False


def request_stop(signum, frame):
    global STOP_REQUESTED
    STOP_REQUESTED = True


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", default="/mnt/efs/catalog/train.csv")
    p.add_argument("--val-csv", default="/mnt/efs/catalog/val.csv")
    p.add_argument("--img-root", default="/mnt/efs/catalog/images")
    p.add_argument("--out", required=True)
    p.add_argument("--num-categories", type=int, default=812)
    p.add_argument("--num-attrs", type=int, default=96)
    p.add_argument("--bs", type=int, default=48)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--attr-weight", type=float, default=0.5)
    p.add_argument("--keep", type=int, default=3)
    return p.parse_args()


class CatalogDataset(Dataset):
    def __init__(self, csv, root, num_attrs, train):
        self.df = pd.read_csv(csv)
        self.root, self.num_attrs = root, num_attrs
        norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        self.tf = transforms.Compose(
            [transforms.RandomResizedCrop(300), transforms.RandomHorizontalFlip(),
             transforms.ToTensor(), norm] if train else
            [transforms.Resize(320), transforms.CenterCrop(300), transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = self.tf(Image.open(os.path.join(self.root, r.path)).convert("RGB"))
        attrs = torch.zeros(self.num_attrs)
        if isinstance(r.attrs, str) and r.attrs:
            attrs[[int(a) for a in r.attrs.split("|")]] = 1.0
        return img, int(r.category), attrs


class CatalogNet(nn.Module):
    def __init__(self, n_cat, n_attr):
        super().__init__()
        self.backbone = timm.create_model("efficientnet_b3", pretrained=True, num_classes=0)
        d = self.backbone.num_features
        self.cat_head = nn.Sequential(nn.Dropout(0.3), nn.Linear(d, n_cat))
        self.attr_head = nn.Linear(d, n_attr)

    def forward(self, x):
        f = self.backbone(x)
        return self.cat_head(f), self.attr_head(f)


def save(out, epoch, step, model, opt, sched, scaler, best, keep):
    path = os.path.join(out, f"ckpt_{epoch:03d}_{step:06d}.pt")
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                "epoch": epoch, "step": step, "best": best}, path + ".tmp")
    os.replace(path + ".tmp", path)
    for old in sorted(glob.glob(os.path.join(out, "ckpt_*.pt")))[:-keep]:
        os.remove(old)


@torch.no_grad()
def evaluate(model, loader, device):
    net = model.module
    net.eval()
    s = torch.zeros(4, device=device)  # correct_cat, n, attr_tp, attr_pos+pred
    for img, cat, attrs in loader:
        img, cat, attrs = img.to(device), cat.to(device), attrs.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            lc, la = net(img)
        s[0] += (lc.argmax(1) == cat).sum()
        s[1] += cat.numel()
        pred = (la.float().sigmoid() > 0.5).float()
        s[2] += 2 * (pred * attrs).sum()
        s[3] += pred.sum() + attrs.sum()
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item(), (s[2] / s[3].clamp(min=1)).item()


def main():
    args = cli()
    signal.signal(signal.SIGTERM, request_stop)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.out, exist_ok=True)

    train_ds = CatalogDataset(args.train_csv, args.img_root, args.num_attrs, True)
    val_ds = CatalogDataset(args.val_csv, args.img_root, args.num_attrs, False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                        num_workers=6, pin_memory=True)

    model = CatalogNet(args.num_categories, args.num_attrs)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    updates_per_epoch = len(train_dl) // args.accum
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, pct_start=0.1,
                                                total_steps=args.epochs * updates_per_epoch)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, start_step, best = 0, 0, 0.0
    ckpts = sorted(glob.glob(os.path.join(args.out, "ckpt_*.pt")))
    if ckpts:
        ck = torch.load(ckpts[-1], map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, start_step, best = ck["epoch"], ck["step"], ck["best"]
        if rank == 0:
            print(f"resumed from {ckpts[-1]}", flush=True)

    stop_flag = torch.zeros(1, device=device)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        it = iter(train_dl)
        first = start_step if epoch == start_epoch else 0
        for _ in range(first * args.accum):
            next(it)
        for step in range(first, updates_per_epoch):
            for micro in range(args.accum):
                img, cat, attrs = next(it)
                img, cat, attrs = (img.to(device, non_blocking=True), cat.to(device, non_blocking=True),
                                   attrs.to(device, non_blocking=True))
                sync_now = micro == args.accum - 1
                ctx = contextlib.nullcontext() if sync_now else model.no_sync()
                with ctx:
                    with torch.autocast("cuda", dtype=torch.float16):
                        lc, la = model(img)
                        loss = F.cross_entropy(lc, cat, label_smoothing=0.1) + \
                            args.attr_weight * F.binary_cross_entropy_with_logits(la, attrs)
                    scaler.scale(loss / args.accum).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()

            # every rank contributes its local flag; if any node was told to stop, all stop together
            stop_flag.fill_(1.0 if STOP_REQUESTED else 0.0)
            dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX)
            if stop_flag.item() > 0:
                if rank == 0:
                    save(args.out, epoch, step + 1, model, opt, sched, scaler, best, args.keep)
                    print(f"stop requested, saved at epoch {epoch} step {step + 1}", flush=True)
                dist.barrier()
                dist.destroy_process_group()
                return

            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} upd {step}/{updates_per_epoch} loss {loss.item():.4f} "
                      f"scale {scaler.get_scale():.0f} {(time.time() - t0) / (step - first + 1):.2f}s/upd",
                      flush=True)

        acc, attr_f1 = evaluate(model, val_dl, device)
        score = acc + attr_f1
        if rank == 0:
            print(f"epoch {epoch}: cat_acc {acc:.4f} attr_f1 {attr_f1:.4f}", flush=True)
            if score > best:
                best = score
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            save(args.out, epoch + 1, 0, model, opt, sched, scaler, best, args.keep)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
