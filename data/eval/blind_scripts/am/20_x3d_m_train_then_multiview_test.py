"""X3D-M on Kinetics-400: train with single-clip validation, keep the best weights, then
run the final 10-clip x 3-crop test on those weights in the same job.

    torchrun --nproc_per_node=8 20_x3d_m_train_then_multiview_test.py --data /data/k400 \
        --out runs/x3d_m_k400 --epochs 300
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from pytorchvideo.models.x3d import create_x3d
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

FRAMES, RATE, CROP = 16, 5, 224


def build_model():
    return create_x3d(input_clip_length=FRAMES, input_crop_size=CROP, model_num_class=400,
                      depth_factor=2.2, width_factor=2.0, dropout_rate=0.5)


def read_list(path):
    with open(path) as f:
        return [(a, int(b)) for a, b in (l.split() for l in f if l.strip())]


def decode(path, starts):
    vr = VideoReader(path, ctx=cpu(0), num_threads=1)
    n = len(vr)
    idx = np.concatenate([np.minimum(np.arange(s, s + FRAMES * RATE, RATE), n - 1) for s in starts(n)])
    x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
    return (x - 0.45) / 0.225                               # C, k*T, H, W


def short_side(x, size):
    return F.interpolate(x, scale_factor=size / min(x.shape[-2:]), mode="bilinear", align_corners=False)


class TrainClips(Dataset):
    def __init__(self, root, items, train):
        self.root, self.items, self.train = root, items, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        for _ in range(10):
            rel, label = self.items[i]
            try:
                if self.train:
                    x = decode(os.path.join(self.root, rel), lambda n: [random.randint(0, max(n - FRAMES * RATE, 0))])
                else:
                    x = decode(os.path.join(self.root, rel), lambda n: [max(n - FRAMES * RATE, 0) // 2])
                break
            except Exception:
                i = random.randrange(len(self.items))
        else:
            raise RuntimeError("no decodable video found")
        x = short_side(x, random.randint(256, 320) if self.train else 256)
        h, w = x.shape[-2:]
        y0 = random.randint(0, h - CROP) if self.train else (h - CROP) // 2
        x0 = random.randint(0, w - CROP) if self.train else (w - CROP) // 2
        x = x[..., y0:y0 + CROP, x0:x0 + CROP]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return x, label


class MultiViewClips(Dataset):
    """All 10 x 3 views of one video; unreadable videos return an empty tensor."""

    def __init__(self, root, items, clips=10, crops=3):
        self.root, self.items, self.clips, self.crops = root, items, clips, crops

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rel, label = self.items[i]
        try:
            x = decode(os.path.join(self.root, rel),
                       lambda n: np.linspace(0, max(n - FRAMES * RATE, 0), self.clips).astype(int))
        except Exception:
            return torch.empty(0), label
        x = short_side(x, CROP)
        h, w = x.shape[-2:]
        views = []
        for c in range(self.clips):
            clip = x[:, c * FRAMES:(c + 1) * FRAMES]
            for k in range(self.crops):
                off = [0, (max(h, w) - CROP) // 2, max(h, w) - CROP][k]
                views.append(clip[..., :, off:off + CROP] if w >= h else clip[..., off:off + CROP, :])
        return torch.stack(views), label


def topk_counts(logits, y):
    top5 = logits.topk(5, 1).indices
    return torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum()]).float()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        acc[:2] += topk_counts(logits, y)
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[:2] / acc[2]).tolist()


@torch.no_grad()
def multiview_test(model, loader, device):
    model.eval()
    acc = torch.zeros(4, device=device)  # top1, top5, videos, unreadable
    for views, y in loader:
        views = views[0]
        if views.numel() == 0:
            acc[3] += 1
            acc[2] += 1
            continue
        with torch.autocast("cuda", dtype=torch.float16):
            probs = model(views.to(device, non_blocking=True)).float().softmax(1).mean(0, keepdim=True)
        acc[:2] += topk_counts(probs, y.to(device))
        acc[2] += 1
    dist.all_reduce(acc)
    return {"top1": (100 * acc[0] / acc[2]).item(), "top5": (100 * acc[1] / acc[2]).item(),
            "videos": int(acc[2]), "unreadable": int(acc[3])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/x3d_m_k400")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=35)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.1, help="for 128 clips")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--val-every", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)

    root = os.path.join(args.data, "videos")
    train_items, val_items = read_list(os.path.join(args.data, "train.txt")), read_list(os.path.join(args.data, "val.txt"))
    train_set = TrainClips(root, train_items, True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_shard = list(range(rank, len(val_items), world))
    val_loader = DataLoader(Subset(TrainClips(root, val_items, False), val_shard), args.batch_size,
                            num_workers=args.workers, pin_memory=True)

    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    iters = len(train_loader)
    best_path = os.path.join(args.out, "best.pth")
    best = -1.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(train_loader):
            e = epoch + it / iters
            cur = lr * 0.5 * (1 + math.cos(math.pi * e / args.epochs))
            if e < args.warmup:
                cur = 0.01 * lr + (cur - 0.01 * lr) * e / args.warmup
            for g in optimizer.param_groups:
                g["lr"] = cur
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} {it}/{iters} loss {loss.item():.3f} lr {cur:.4f} {time.time() - tic:.0f}s",
                      flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            top1, top5 = validate(model.module, val_loader, device)
            if rank == 0:
                print(f"epoch {epoch}: 1-view top1 {top1:.2f} top5 {top5:.2f}", flush=True)
                if top1 > best:
                    best = top1
                    torch.save({"model": model.state_dict(), "epoch": epoch, "top1": top1}, best_path)
            dist.barrier()

    # ---- final multi-view test with the best weights
    test_model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model())
    ckpt = torch.load(best_path, map_location="cpu")
    test_model.load_state_dict(ckpt["model"])
    test_model.to(device)
    test_loader = DataLoader(Subset(MultiViewClips(root, val_items), val_shard), batch_size=1,
                             num_workers=args.workers, pin_memory=True)
    res = multiview_test(test_model, test_loader, device)
    if rank == 0:
        res["best_epoch"] = ckpt["epoch"]
        print("10x3 test:", json.dumps(res), flush=True)
        with open(os.path.join(args.out, "test_10x3.json"), "w") as f:
            json.dump(res, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
