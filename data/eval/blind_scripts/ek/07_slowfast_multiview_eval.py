#!/usr/bin/env python
"""SlowFast-R50 8x8 on Kinetics-400 with 10x3 multi-view testing.

  train : torchrun --nproc_per_node=8 07_slowfast_multiview_eval.py --root /data/k400 --out runs/sf8x8
  test  : torchrun --nproc_per_node=8 07_slowfast_multiview_eval.py --root /data/k400 --out runs/sf8x8 \
              --test-only --weights runs/sf8x8/checkpoint_epoch_196.pyth
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-classes", type=int, default=400)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--rate", type=int, default=2)
    p.add_argument("--alpha", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=196)
    p.add_argument("--lr", type=float, default=0.1, help="at 64 clips/iteration")
    p.add_argument("--warmup", type=float, default=34.0)
    p.add_argument("--clips", type=int, default=10)
    p.add_argument("--crops", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--test-only", action="store_true")
    p.add_argument("--weights", default="")
    return p.parse_args()


def conv_bn(cin, cout, k, s=(1, 1, 1), pad=(0, 0, 0)):
    return nn.Sequential(nn.Conv3d(cin, cout, k, s, pad, bias=False), nn.BatchNorm3d(cout), nn.ReLU(inplace=True))


class Bottleneck(nn.Module):
    def __init__(self, cin, cout, stride, tk):
        super().__init__()
        mid = cout // 4
        self.body = nn.Sequential(conv_bn(cin, mid, (tk, 1, 1), pad=(tk // 2, 0, 0)),
                                  conv_bn(mid, mid, (1, 3, 3), (1, stride, stride), (0, 1, 1)),
                                  nn.Conv3d(mid, cout, 1, bias=False), nn.BatchNorm3d(cout))
        self.proj = None
        if stride != 1 or cin != cout:
            self.proj = nn.Sequential(nn.Conv3d(cin, cout, 1, (1, stride, stride), bias=False), nn.BatchNorm3d(cout))

    def forward(self, x):
        return F.relu(self.body(x) + (x if self.proj is None else self.proj(x)))


class SlowFast(nn.Module):
    def __init__(self, num_classes, alpha=4, beta_inv=8, depth=(3, 4, 6, 3)):
        super().__init__()
        self.alpha = alpha
        sw, fw = [64, 256, 512, 1024, 2048], [64 // beta_inv, 256 // beta_inv, 512 // beta_inv, 1024 // beta_inv,
                                             2048 // beta_inv]
        pool = nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1))
        self.s_stem = nn.Sequential(conv_bn(3, sw[0], (1, 7, 7), (1, 2, 2), (0, 3, 3)), pool)
        self.f_stem = nn.Sequential(conv_bn(3, fw[0], (5, 7, 7), (1, 2, 2), (2, 3, 3)), pool)
        self.lateral = nn.ModuleList()
        self.s_res, self.f_res = nn.ModuleList(), nn.ModuleList()
        for i in range(4):
            self.lateral.append(conv_bn(fw[i], 2 * fw[i], (5, 1, 1), (alpha, 1, 1), (2, 0, 0)))
            blocks_s, blocks_f = [], []
            for j in range(depth[i]):
                st = 2 if (j == 0 and i > 0) else 1
                blocks_s.append(Bottleneck((sw[i] + 2 * fw[i]) if j == 0 else sw[i + 1], sw[i + 1], st, 1 if i < 2 else 3))
                blocks_f.append(Bottleneck(fw[i] if j == 0 else fw[i + 1], fw[i + 1], st, 3))
            self.s_res.append(nn.Sequential(*blocks_s))
            self.f_res.append(nn.Sequential(*blocks_f))
        self.drop = nn.Dropout(0.5)
        self.proj = nn.Linear(sw[-1] + fw[-1], num_classes)

    def forward(self, x):
        s, f = self.s_stem(x[:, :, ::self.alpha]), self.f_stem(x)
        for i in range(4):
            s = torch.cat([s, self.lateral[i](f)], dim=1)
            s, f = self.s_res[i](s), self.f_res[i](f)
        return self.proj(self.drop(torch.cat([s.mean((2, 3, 4)), f.mean((2, 3, 4))], 1)))


def build_index(root, split, rank):
    """Frame counts of every video, cached next to the annotation file (rank 0 writes, the others wait)."""
    cache = os.path.join(root, f"{split}_frames.json")
    if rank == 0 and not os.path.exists(cache):
        rows = []
        with open(os.path.join(root, f"{split}.csv")) as f:
            for line in f:
                path, label = line.split()
                rows.append([path, int(label), len(VideoReader(os.path.join(root, path), ctx=cpu(0)))])
        with open(cache + ".tmp", "w") as f:
            json.dump(rows, f)
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    with open(cache) as f:
        return json.load(f)


class KineticsViews(Dataset):
    """Train: one random clip per video. Test: item i is view (i % V) of video (i // V)."""

    def __init__(self, root, rows, frames, rate, train, clips=1, crops=1):
        self.root, self.rows, self.frames, self.rate, self.train = root, rows, frames, rate, train
        self.clips, self.crops = clips, crops
        self.views = 1 if train else clips * crops

    def __len__(self):
        return len(self.rows) * self.views

    def __getitem__(self, i):
        vid, view = divmod(i, self.views)
        path, label, n = self.rows[vid]
        span = self.frames * self.rate
        if self.train:
            start = np.random.randint(0, max(n - span, 0) + 1)
        else:
            start = int(max(n - span, 0) * (view // self.crops) / max(self.clips - 1, 1))
        idx = np.clip(np.arange(start, start + span, self.rate), 0, n - 1)
        vr = VideoReader(os.path.join(self.root, path), ctx=cpu(0), num_threads=1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        short = np.random.randint(256, 321) if self.train else 256
        x = F.interpolate(x, scale_factor=short / min(x.shape[-2:]), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            y0, x0 = np.random.randint(0, h - 223), np.random.randint(0, w - 223)
        else:
            k = view % self.crops
            y0 = (h - 224) * k // max(self.crops - 1, 1) if h > w else (h - 224) // 2
            x0 = (w - 224) * k // max(self.crops - 1, 1) if w >= h else (w - 224) // 2
        x = x[..., y0:y0 + 224, x0:x0 + 224]
        if self.train and np.random.rand() < 0.5:
            x = x.flip(-1)
        return (x - 0.45) / 0.225, label, vid


@torch.no_grad()
def multi_view_test(model, dataset, args, rank, world, device):
    # DistributedSampler pads the view list to a multiple of world; the padded
    # positions (>= len(dataset)) are masked out so no view is counted twice.
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers, pin_memory=True)
    n_videos = len(dataset.rows)
    scores = torch.zeros(n_videos, args.num_classes, device=device)
    labels = torch.full((n_videos,), -1, dtype=torch.long, device=device)
    model.eval()
    seen = 0
    for x, y, vid in loader:
        b = x.shape[0]
        pos = rank + world * torch.arange(seen, seen + b, device=device)
        seen += b
        valid = pos < len(dataset)
        with torch.autocast("cuda", dtype=torch.float16):
            prob = model(x.to(device, non_blocking=True)).float().softmax(-1)
        vid, y = vid.to(device)[valid], y.to(device)[valid]
        scores.index_add_(0, vid, prob[valid])
        labels[vid] = y
    dist.all_reduce(scores)
    dist.all_reduce(labels, op=dist.ReduceOp.MAX)
    top5 = scores.topk(5, 1).indices
    top1 = (top5[:, 0] == labels).float().mean().item() * 100
    top5 = (top5 == labels[:, None]).any(1).float().mean().item() * 100
    return top1, top5


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")

    model = SlowFast(args.num_classes, args.alpha)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    if args.weights:
        state = torch.load(args.weights, map_location="cpu")
        model.load_state_dict(state["model_state"])
    ddp_model = DDP(model, device_ids=[local_rank])

    test_rows = build_index(args.root, "val", rank)
    test_set = KineticsViews(args.root, test_rows, args.frames, args.rate, False, args.clips, args.crops)
    if args.test_only:
        top1, top5 = multi_view_test(model, test_set, args, rank, world, device)
        log.info("%dx%d views: top1 %.2f top5 %.2f", args.clips, args.crops, top1, top5)
        dist.destroy_process_group()
        return

    train_rows = build_index(args.root, "train", rank)
    train_set = KineticsViews(args.root, train_rows, args.frames, args.rate, True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    peak = args.lr * args.batch * world / 64
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=peak, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        for it, (x, y, _) in enumerate(loader):
            e = epoch + it / len(loader)
            lr = peak * (0.01 + 0.99 * e / args.warmup) if e < args.warmup else \
                peak * 0.5 * (1 + np.cos(np.pi * e / args.epochs))
            for g in optimizer.param_groups:
                g["lr"] = lr
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(ddp_model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % 50 == 0:
                log.info("ep %d it %d/%d loss %.3f lr %.4f %.2fs/it", epoch, it, len(loader), loss.item(), lr,
                         (time.time() - tic) / (it + 1))
        if rank == 0 and ((epoch + 1) % 10 == 0 or epoch + 1 == args.epochs):
            torch.save({"epoch": epoch, "model_state": model.state_dict(), "optimizer_state": optimizer.state_dict()},
                       os.path.join(args.out, f"checkpoint_epoch_{epoch + 1}.pyth"))
        dist.barrier()

    top1, top5 = multi_view_test(model, test_set, args, rank, world, device)
    log.info("final %dx%d views: top1 %.2f top5 %.2f", args.clips, args.crops, top1, top5)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
