#!/usr/bin/env python3
"""SlowFast-R50 8x8 on Kinetics-600 with periodic checkpointing + auto-resume.

    torchrun --nproc_per_node=8 18_slowfast_r50_ckpt.py --cfg configs/k600_sf_r50_8x8.yaml OUTPUT_DIR=/mnt/lab/exp/k600_sf
"""
import argparse
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

_C = {
    "DATA_ROOT": "/mnt/lab/datasets/k600", "NUM_CLASSES": 600, "NUM_FRAMES": 32, "SAMPLING_RATE": 2, "ALPHA": 4,
    "BATCH_PER_GPU": 8, "MAX_EPOCH": 196, "BASE_LR": 0.1, "BASE_BATCH": 64, "WARMUP_EPOCHS": 34,
    "WEIGHT_DECAY": 1e-4, "NUM_WORKERS": 8, "OUTPUT_DIR": "./output", "CHECKPOINT_PERIOD": 5, "EVAL_PERIOD": 10,
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="")
    ap.add_argument("opts", nargs="*")
    a = ap.parse_args()
    cfg = dict(_C)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f))
    for o in a.opts:
        k, v = o.split("=", 1)
        cfg[k] = yaml.safe_load(v)
    return cfg


def conv_bn_relu(i, o, k, s, p, relu=True):
    layers = [nn.Conv3d(i, o, k, s, p, bias=False), nn.BatchNorm3d(o)]
    if relu:
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class BottleneckBlock(nn.Module):
    def __init__(self, dim_in, dim_out, stride, temp_kernel):
        super().__init__()
        inner = dim_out // 4
        self.branch2 = nn.Sequential(
            conv_bn_relu(dim_in, inner, (temp_kernel, 1, 1), 1, (temp_kernel // 2, 0, 0)),
            conv_bn_relu(inner, inner, (1, 3, 3), (1, stride, stride), (0, 1, 1)),
            conv_bn_relu(inner, dim_out, 1, 1, 0, relu=False))
        self.branch1 = None
        if dim_in != dim_out or stride != 1:
            self.branch1 = conv_bn_relu(dim_in, dim_out, 1, (1, stride, stride), 0, relu=False)

    def forward(self, x):
        return F.relu(self.branch2(x) + (x if self.branch1 is None else self.branch1(x)))


class SlowFast(nn.Module):
    def __init__(self, num_classes, alpha=4):
        super().__init__()
        self.alpha = alpha
        pool = nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1))
        self.s1 = nn.ModuleList([nn.Sequential(conv_bn_relu(3, 64, (1, 7, 7), (1, 2, 2), (0, 3, 3)), pool),
                                 nn.Sequential(conv_bn_relu(3, 8, (5, 7, 7), (1, 2, 2), (2, 3, 3)), pool)])
        slow_dims, fast_dims, depths = [64, 256, 512, 1024, 2048], [8, 32, 64, 128, 256], [3, 4, 6, 3]
        self.fuse = nn.ModuleList()
        self.stages = nn.ModuleList()
        for i, d in enumerate(depths):
            self.fuse.append(conv_bn_relu(fast_dims[i], 2 * fast_dims[i], (5, 1, 1), (alpha, 1, 1), (2, 0, 0)))
            stride = 1 if i == 0 else 2
            slow = [BottleneckBlock(slow_dims[i] + 2 * fast_dims[i] if j == 0 else slow_dims[i + 1], slow_dims[i + 1],
                                    stride if j == 0 else 1, 1 if i < 2 else 3) for j in range(d)]
            fast = [BottleneckBlock(fast_dims[i] if j == 0 else fast_dims[i + 1], fast_dims[i + 1],
                                    stride if j == 0 else 1, 3) for j in range(d)]
            self.stages.append(nn.ModuleList([nn.Sequential(*slow), nn.Sequential(*fast)]))
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(slow_dims[-1] + fast_dims[-1], num_classes))

    def forward(self, frames):
        slow = self.s1[0](frames[:, :, ::self.alpha])
        fast = self.s1[1](frames)
        for fuse, (slow_stage, fast_stage) in zip(self.fuse, self.stages):
            slow = slow_stage(torch.cat([slow, fuse(fast)], dim=1))
            fast = fast_stage(fast)
        return self.head(torch.cat([slow.mean(dim=(2, 3, 4)), fast.mean(dim=(2, 3, 4))], dim=1))


class Kinetics(Dataset):
    def __init__(self, cfg, split):
        self.cfg, self.train = cfg, split == "train"
        self.root = cfg["DATA_ROOT"]
        with open(os.path.join(self.root, f"{split}.csv")) as f:
            self.items = [(p, int(l)) for p, l in (ln.split() for ln in f if ln.strip())]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        vr = VideoReader(os.path.join(self.root, path), ctx=cpu(0), num_threads=1)
        n, rate = len(vr), self.cfg["SAMPLING_RATE"]
        span = self.cfg["NUM_FRAMES"] * rate
        start = np.random.randint(0, max(1, n - span + 1)) if self.train else max(0, n - span) // 2
        x = torch.from_numpy(vr.get_batch(np.minimum(np.arange(start, start + span, rate), n - 1)).asnumpy())
        x = x.permute(3, 0, 1, 2).float() / 255.0
        size = np.random.randint(256, 321) if self.train else 256
        x = F.interpolate(x, scale_factor=size / min(x.shape[-2:]), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        y0 = np.random.randint(0, h - 223) if self.train else (h - 224) // 2
        x0 = np.random.randint(0, w - 223) if self.train else (w - 224) // 2
        x = x[..., y0:y0 + 224, x0:x0 + 224]
        if self.train and np.random.rand() < 0.5:
            x = x.flip(-1)
        return (x - 0.45) / 0.225, label


def save_checkpoint(out_dir, model, optimizer, scaler, epoch, best_acc, is_best):
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"checkpoint_epoch_{epoch + 1:05d}.pyth")
    torch.save({"epoch": epoch, "model_state": model.module.state_dict(), "optimizer_state": optimizer.state_dict(),
                "scaler_state": scaler.state_dict(), "best_acc": best_acc}, path)
    with open(os.path.join(ckpt_dir, "last_checkpoint"), "w") as f:
        f.write(os.path.basename(path))
    if is_best:
        shutil.copyfile(path, os.path.join(ckpt_dir, "best.pyth"))


def load_last_checkpoint(out_dir, model, optimizer, scaler):
    marker = os.path.join(out_dir, "checkpoints", "last_checkpoint")
    if not os.path.exists(marker):
        return 0, 0.0
    with open(marker) as f:
        name = f.read().strip()
    state = torch.load(os.path.join(out_dir, "checkpoints", name), map_location="cpu")
    model.module.load_state_dict(state["model_state"])
    optimizer.load_state_dict(state["optimizer_state"])
    scaler.load_state_dict(state["scaler_state"])
    return state["epoch"] + 1, state["best_acc"]


@torch.no_grad()
def eval_epoch(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            top5 = model(x).topk(5, 1).indices
        s += torch.stack([(top5[:, 0] == y).sum().float(), (top5 == y[:, None]).any(1).sum().float(),
                          torch.tensor(float(len(y)), device=device)])
    dist.all_reduce(s)
    return (s[0] / s[2] * 100).item(), (s[1] / s[2] * 100).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_master = rank == 0

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SlowFast(cfg["NUM_CLASSES"], cfg["ALPHA"])).to(device)
    model = DDP(model, device_ids=[local_rank])
    peak_lr = cfg["BASE_LR"] * cfg["BATCH_PER_GPU"] * world / cfg["BASE_BATCH"]
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=cfg["WEIGHT_DECAY"],
                                nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch, best_acc = load_last_checkpoint(cfg["OUTPUT_DIR"], model, optimizer, scaler)

    train_set, val_set = Kinetics(cfg, "train"), Kinetics(cfg, "val")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg["BATCH_PER_GPU"], sampler=sampler, num_workers=cfg["NUM_WORKERS"],
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=cfg["BATCH_PER_GPU"], num_workers=cfg["NUM_WORKERS"], pin_memory=True)
    if is_master:
        print(f"start at epoch {start_epoch}, peak lr {peak_lr:.3f}, {len(loader)} iters/epoch", flush=True)

    for epoch in range(start_epoch, cfg["MAX_EPOCH"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(loader):
            ep = epoch + it / len(loader)
            if ep < cfg["WARMUP_EPOCHS"]:
                lr = peak_lr * (0.01 + 0.99 * ep / cfg["WARMUP_EPOCHS"])
            else:
                lr = peak_lr * 0.5 * (1.0 + np.cos(np.pi * ep / cfg["MAX_EPOCH"]))
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if is_master and it % 50 == 0:
                print(f"[{epoch}][{it}/{len(loader)}] loss {loss.item():.4f} lr {lr:.4f} "
                      f"{(time.time() - tic) / (it + 1):.2f}s/it", flush=True)

        top1 = None
        if (epoch + 1) % cfg["EVAL_PERIOD"] == 0 or epoch + 1 == cfg["MAX_EPOCH"]:
            top1, top5 = eval_epoch(model.module, val_loader, device)
            if is_master:
                print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f}", flush=True)
        is_best = top1 is not None and top1 > best_acc
        best_acc = max(best_acc, top1 or 0.0)
        if (epoch + 1) % cfg["CHECKPOINT_PERIOD"] == 0 or is_best:
            save_checkpoint(cfg["OUTPUT_DIR"], model, optimizer, scaler, epoch, best_acc, is_best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
