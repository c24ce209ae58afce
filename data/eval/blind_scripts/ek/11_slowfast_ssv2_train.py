"""SlowFast R50 16x8 on Something-Something V2 (fine-tuned from our K400 checkpoint).

Launch (1 node, 8 GPUs):
    torchrun --nproc_per_node=8 11_slowfast_ssv2_train.py --cfg configs/ssv2_slowfast_r50.json
"""
import argparse
import json
import logging
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("sf_ssv2")

CFG = {
    "root": "/data/ssv2", "num_classes": 174, "fast_frames": 32, "alpha": 4, "batch_per_gpu": 4,
    "epochs": 22, "base_lr": 0.03, "lr_ref_batch": 64, "warmup_epochs": 0.19, "wd": 1e-6,
    "workers": 8, "out": "runs/sf_ssv2", "init": "runs/sf_k400/checkpoint_epoch_196.pyth",
}


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride, tk):
        super().__init__()
        mid = cout // 4
        self.c1 = nn.Conv3d(cin, mid, (tk, 1, 1), padding=(tk // 2, 0, 0), bias=False)
        self.c2 = nn.Conv3d(mid, mid, (1, 3, 3), (1, stride, stride), (0, 1, 1), bias=False)
        self.c3 = nn.Conv3d(mid, cout, 1, bias=False)
        self.n1, self.n2, self.n3 = nn.BatchNorm3d(mid), nn.BatchNorm3d(mid), nn.BatchNorm3d(cout)
        self.skip = (nn.Sequential(nn.Conv3d(cin, cout, 1, (1, stride, stride), bias=False), nn.BatchNorm3d(cout))
                     if (cin != cout or stride > 1) else nn.Identity())

    def forward(self, x):
        y = F.relu(self.n1(self.c1(x)))
        y = F.relu(self.n2(self.c2(y)))
        return F.relu(self.n3(self.c3(y)) + self.skip(x))


class SlowFast(nn.Module):
    def __init__(self, num_classes, alpha=4):
        super().__init__()
        self.alpha = alpha
        self.slow_stem = nn.Sequential(nn.Conv3d(3, 64, (1, 7, 7), (1, 2, 2), (0, 3, 3), bias=False),
                                       nn.BatchNorm3d(64), nn.ReLU(), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.fast_stem = nn.Sequential(nn.Conv3d(3, 8, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
                                       nn.BatchNorm3d(8), nn.ReLU(), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        s_ch, f_ch = [64, 256, 512, 1024, 2048], [8, 32, 64, 128, 256]
        depths = [3, 4, 6, 3]
        self.laterals = nn.ModuleList()
        self.slow, self.fast = nn.ModuleList(), nn.ModuleList()
        for i, d in enumerate(depths):
            self.laterals.append(nn.Sequential(
                nn.Conv3d(f_ch[i], 2 * f_ch[i], (5, 1, 1), (alpha, 1, 1), (2, 0, 0), bias=False),
                nn.BatchNorm3d(2 * f_ch[i]), nn.ReLU()))
            s = 1 if i == 0 else 2
            self.slow.append(nn.Sequential(*[ResBlock(s_ch[i] + 2 * f_ch[i] if j == 0 else s_ch[i + 1], s_ch[i + 1],
                                                      s if j == 0 else 1, 1 if i < 2 else 3) for j in range(d)]))
            self.fast.append(nn.Sequential(*[ResBlock(f_ch[i] if j == 0 else f_ch[i + 1], f_ch[i + 1],
                                                      s if j == 0 else 1, 3) for j in range(d)]))
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(s_ch[-1] + f_ch[-1], num_classes)

    def forward(self, x):
        slow, fast = self.slow_stem(x[:, :, ::self.alpha]), self.fast_stem(x)
        for lat, sb, fb in zip(self.laterals, self.slow, self.fast):
            slow = sb(torch.cat([slow, lat(fast)], 1))
            fast = fb(fast)
        pooled = torch.cat([F.adaptive_avg_pool3d(slow, 1).flatten(1), F.adaptive_avg_pool3d(fast, 1).flatten(1)], 1)
        return self.fc(self.dropout(pooled))


class SSV2(Dataset):
    def __init__(self, root, split, frames, train):
        self.root, self.frames, self.train = root, frames, train
        with open(os.path.join(root, "labels", f"{split}.json")) as f:
            self.items = [(d["id"], int(d["label_id"])) for d in json.load(f)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, label = self.items[i]
        vr = VideoReader(os.path.join(self.root, "videos", f"{vid}.webm"), ctx=cpu(0), num_threads=1)
        n = len(vr)
        # uniform segment sampling over the whole (short) video
        seg = n / self.frames
        off = np.random.rand(self.frames) * seg if self.train else np.full(self.frames, seg / 2)
        idx = np.minimum((np.arange(self.frames) * seg + off).astype(int), n - 1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        short = np.random.randint(256, 321) if self.train else 256
        x = F.interpolate(x, scale_factor=short / min(x.shape[-2:]), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        t = np.random.randint(0, h - 223) if self.train else (h - 224) // 2
        l = np.random.randint(0, w - 223) if self.train else (w - 224) // 2
        x = x[..., t:t + 224, l:l + 224]
        return (x - 0.45) / 0.225, label


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        top5 = logits.topk(5, dim=1).indices
        total[0] += (top5[:, 0] == y).sum()
        total[1] += (top5 == y.unsqueeze(1)).any(1).sum()
        total[2] += y.numel()
    dist.all_reduce(total)
    return (100 * total[0] / total[2]).item(), (100 * total[1] / total[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="")
    cli = ap.parse_args()
    cfg = dict(CFG)
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    model = SlowFast(cfg["num_classes"], cfg["alpha"])
    if cfg.get("init"):
        sd = torch.load(cfg["init"], map_location="cpu")["model_state"]
        sd = {k: v for k, v in sd.items() if not k.startswith("fc.")}
        logger.info("init: %s", model.load_state_dict(sd, strict=False))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set, val_set = SSV2(cfg["root"], "train", cfg["fast_frames"], True), SSV2(cfg["root"], "validation",
                                                                                 cfg["fast_frames"], False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_idx = np.array_split(np.arange(len(val_set)), world)[rank].tolist()
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=cfg["batch_per_gpu"],
                            num_workers=cfg["workers"], pin_memory=True)

    peak_lr = cfg["base_lr"] * cfg["batch_per_gpu"] * world / cfg["lr_ref_batch"]
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=cfg["wd"])
    scaler = torch.cuda.amp.GradScaler()
    iters = len(train_loader)
    warm = cfg["warmup_epochs"] * iters
    total_iters = cfg["epochs"] * iters
    if rank == 0:
        os.makedirs(cfg["out"], exist_ok=True)

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(train_loader):
            step = epoch * iters + it
            lr = peak_lr * step / warm if step < warm else \
                peak_lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total_iters - warm)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            if not torch.isfinite(loss):
                logger.warning("non-finite loss at epoch %d iter %d, skipping batch", epoch, it)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % 50 == 0:
                logger.info("epoch %d [%d/%d] loss %.4f lr %.5f %.2fs/it", epoch, it, iters, loss.item(), lr,
                            (time.time() - tic) / (it + 1))

        top1, top5 = evaluate(model.module, val_loader, device)
        logger.info("epoch %d val top1 %.2f top5 %.2f", epoch, top1, top5)
        if rank == 0:
            torch.save({"epoch": epoch, "model_state": model.module.state_dict(),
                        "optimizer_state": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(cfg["out"], f"checkpoint_epoch_{epoch + 1:03d}.pyth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
