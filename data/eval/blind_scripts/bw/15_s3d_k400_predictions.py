"""S3D on Kinetics-400 with DDP. At every evaluation the per-video predictions of all
ranks are collected on rank 0 and written to a CSV, together with per-class accuracy.

    torchrun --nproc_per_node=8 15_s3d_k400_predictions.py --root /data/k400 --out /exp/s3d_k400
"""
import argparse
import csv
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import s3d


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--rate", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.1, help="for 256 clips per step")
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=5)
    return ap.parse_args()


def read_split(root, split, classes=None):
    rows = []
    with open(os.path.join(root, "annotations", f"{split}.csv")) as f:
        for r in csv.DictReader(f):
            vid = f"{r['youtube_id']}_{int(r['time_start']):06d}_{int(r['time_end']):06d}"
            rows.append((vid, os.path.join(root, split, r["label"], vid + ".mp4"), r["label"]))
    if classes is None:
        classes = sorted({r[2] for r in rows})
    idx = {c: i for i, c in enumerate(classes)}
    return [(v, p, idx[l]) for v, p, l in rows], classes


class Clips(Dataset):
    mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
    std = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __init__(self, rows, frames, rate, train):
        self.rows, self.frames, self.rate, self.train = rows, frames, rate, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        _, path, label = self.rows[i]
        vr = VideoReader(path, ctx=cpu(0), width=-1, height=-1, num_threads=1)
        n, span = len(vr), self.frames * self.rate
        s = random.randint(0, max(0, n - span)) if self.train else max(0, n - span) // 2
        ids = np.minimum(np.arange(s, s + span, self.rate), n - 1)
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float().div_(255)
        h, w = x.shape[-2:]
        short = random.randint(256, 320) if self.train else 256
        x = F.interpolate(x, scale_factor=short / min(h, w), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            a, b = random.randint(0, h - 224), random.randint(0, w - 224)
        else:
            a, b = (h - 224) // 2, (w - 224) // 2
        x = x[..., a:a + 224, b:b + 224]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return (x.transpose(0, 1) - self.mean) / self.std, label, i


class ContiguousShard(torch.utils.data.Sampler):
    """Each rank scores a contiguous block of the eval set; nothing is repeated."""

    def __init__(self, n, world, rank):
        per = math.ceil(n / world)
        self.ids = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


@torch.no_grad()
def evaluate(net, loader, world, device):
    net.eval()
    preds, labels, idxs = [], [], []
    for x, y, i in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = net(x.to(device, non_blocking=True))
        preds.append(logits.argmax(1))
        labels.append(y.to(device))
        idxs.append(i.to(device))
    local = torch.stack([torch.cat(preds), torch.cat(labels), torch.cat(idxs)], dim=1)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return torch.cat(gathered).cpu()


def report(results, rows, classes, path):
    pred, label, idx = results[:, 0], results[:, 1], results[:, 2]
    top1 = (pred == label).float().mean().item() * 100
    per_class = []
    for c in range(len(classes)):
        m = label == c
        per_class.append((pred[m] == c).float().mean().item() * 100 if m.any() else float("nan"))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["video", "label", "pred"])
        for p, l, i in zip(pred.tolist(), label.tolist(), idx.tolist()):
            w.writerow([rows[i][0], classes[l], classes[p]])
    return top1, float(np.nanmean(per_class))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(rank)

    train_rows, classes = read_split(args.root, "train")
    val_rows, _ = read_split(args.root, "val", classes)
    train_ds, val_ds = Clips(train_rows, args.frames, args.rate, True), Clips(val_rows, args.frames, args.rate, False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=ContiguousShard(len(val_ds), world, rank),
                        num_workers=args.workers, pin_memory=True)

    model = s3d(num_classes=len(classes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    iters = len(train_dl)
    warm, total = args.warmup_epochs * iters, args.epochs * iters
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, y, _) in enumerate(train_dl):
            step = epoch * iters + it
            cur = lr * (step + 1) / warm if step < warm else lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it}/{iters} loss {loss.item():.4f} lr {cur:.4f}", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            results = evaluate(model.module, val_dl, world, device)
            if rank == 0:
                top1, mean_cls = report(results, val_rows, classes,
                                        os.path.join(args.out, f"val_predictions_ep{epoch}.csv"))
                print(f"epoch {epoch}: val top1 {top1:.2f} mean class acc {mean_cls:.2f}", flush=True)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
