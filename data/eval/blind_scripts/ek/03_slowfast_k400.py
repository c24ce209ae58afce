#!/usr/bin/env python
# SlowFast R50 4x16 on Kinetics-400, trained from scratch.
# Usage: torchrun --nproc_per_node=8 03_slowfast_k400.py --cfg configs/slowfast_r50_4x16.yaml
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("slowfast")

DEFAULTS = dict(
    data_root="/data/kinetics400", num_classes=400, num_frames=32, sampling_rate=2, alpha=4,
    batch_per_gpu=8, epochs=196, base_lr=0.1, base_batch=64, warmup_epochs=34, weight_decay=1e-4,
    num_workers=8, out_dir="runs/slowfast_r50_4x16", eval_period=10,
)


def load_cfg():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default=None)
    parser.add_argument("opts", nargs=argparse.REMAINDER)
    a = parser.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.opts:
        k, v = kv.split("=", 1)
        cfg[k] = type(cfg[k])(v)
    return argparse.Namespace(**cfg)


class Bottleneck3d(nn.Module):
    def __init__(self, cin, inner, cout, stride, tk):
        super().__init__()
        self.a = nn.Conv3d(cin, inner, (tk, 1, 1), padding=(tk // 2, 0, 0), bias=False)
        self.a_bn = nn.BatchNorm3d(inner)
        self.b = nn.Conv3d(inner, inner, (1, 3, 3), (1, stride, stride), (0, 1, 1), bias=False)
        self.b_bn = nn.BatchNorm3d(inner)
        self.c = nn.Conv3d(inner, cout, 1, bias=False)
        self.c_bn = nn.BatchNorm3d(cout)
        self.c_bn.weight.data.zero_()
        self.short = None
        if cin != cout or stride != 1:
            self.short = nn.Sequential(nn.Conv3d(cin, cout, 1, (1, stride, stride), bias=False), nn.BatchNorm3d(cout))

    def forward(self, x):
        y = F.relu(self.a_bn(self.a(x)), inplace=True)
        y = F.relu(self.b_bn(self.b(y)), inplace=True)
        y = self.c_bn(self.c(y))
        return F.relu(y + (x if self.short is None else self.short(x)), inplace=True)


def make_stage(cin, inner, cout, depth, stride, tk):
    return nn.Sequential(*[Bottleneck3d(cin if i == 0 else cout, inner, cout, stride if i == 0 else 1, tk)
                           for i in range(depth)])


class Fuse(nn.Module):
    """Time-strided lateral connection from the fast to the slow pathway."""

    def __init__(self, c, alpha):
        super().__init__()
        self.conv = nn.Conv3d(c, 2 * c, (5, 1, 1), (alpha, 1, 1), (2, 0, 0), bias=False)
        self.bn = nn.BatchNorm3d(2 * c)

    def forward(self, slow, fast):
        return torch.cat([slow, F.relu(self.bn(self.conv(fast)), inplace=True)], 1), fast


class SlowFastR50(nn.Module):
    def __init__(self, num_classes, alpha=4, depths=(3, 4, 6, 3)):
        super().__init__()
        self.alpha = alpha
        self.slow_stem = nn.Sequential(nn.Conv3d(3, 64, (1, 7, 7), (1, 2, 2), (0, 3, 3), bias=False),
                                       nn.BatchNorm3d(64), nn.ReLU(inplace=True),
                                       nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.fast_stem = nn.Sequential(nn.Conv3d(3, 8, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
                                       nn.BatchNorm3d(8), nn.ReLU(inplace=True),
                                       nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        slow_out, fast_out = [256, 512, 1024, 2048], [32, 64, 128, 256]
        slow_in, fast_in = 64, 8
        self.fuses = nn.ModuleList([Fuse(fast_in, alpha)])
        self.slow_stages, self.fast_stages = nn.ModuleList(), nn.ModuleList()
        for i, d in enumerate(depths):
            stride = 1 if i == 0 else 2
            self.slow_stages.append(make_stage(slow_in + 2 * fast_in, slow_out[i] // 4, slow_out[i], d, stride,
                                               1 if i < 2 else 3))
            self.fast_stages.append(make_stage(fast_in, fast_out[i] // 4, fast_out[i], d, stride, 3))
            slow_in, fast_in = slow_out[i], fast_out[i]
            if i < 3:
                self.fuses.append(Fuse(fast_in, alpha))
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(slow_out[-1] + fast_out[-1], num_classes)

    def forward(self, fast):
        slow = fast[:, :, ::self.alpha]
        slow, fast = self.slow_stem(slow), self.fast_stem(fast)
        for i in range(4):
            slow, fast = self.fuses[i](slow, fast)
            slow, fast = self.slow_stages[i](slow), self.fast_stages[i](fast)
        feat = torch.cat([slow.mean((2, 3, 4)), fast.mean((2, 3, 4))], 1)
        return self.head(self.dropout(feat))


class KineticsClips(Dataset):
    def __init__(self, root, split, num_frames, rate, train):
        self.root, self.num_frames, self.rate, self.train = root, num_frames, rate, train
        with open(os.path.join(root, f"{split}.csv")) as f:
            self.items = [l.strip().rsplit(" ", 1) for l in f if l.strip()]
        self.mean = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        vr = VideoReader(os.path.join(self.root, path), num_threads=1, ctx=cpu(0))
        span = self.num_frames * self.rate
        n = len(vr)
        start = np.random.randint(0, max(n - span, 0) + 1) if self.train else max(n - span, 0) // 2
        idx = np.clip(np.arange(start, start + span, self.rate), 0, n - 1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        short = int(np.random.randint(256, 321)) if self.train else 256
        h, w = x.shape[-2:]
        x = F.interpolate(x, scale_factor=short / min(h, w), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            top, left = np.random.randint(0, h - 223), np.random.randint(0, w - 223)
        else:
            top, left = (h - 224) // 2, (w - 224) // 2
        x = x[..., top:top + 224, left:left + 224]
        if self.train and np.random.rand() < 0.5:
            x = x.flip(-1)
        return (x - self.mean) / self.std, int(label)


def lr_at(cfg, epoch_float, peak):
    if epoch_float < cfg.warmup_epochs:
        start = peak * 0.01
        return start + (peak - start) * epoch_float / cfg.warmup_epochs
    return peak * 0.5 * (1 + np.cos(np.pi * epoch_float / cfg.epochs))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    counts = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        top5 = out.topk(5, 1).indices
        counts += torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum(),
                               torch.tensor(y.numel(), device=device)]).float()
    dist.all_reduce(counts)
    return (counts[0] / counts[2] * 100).item(), (counts[1] / counts[2] * 100).item()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    model = SlowFastR50(cfg.num_classes, cfg.alpha)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DistributedDataParallel(model.to(device), device_ids=[local_rank], output_device=local_rank)

    train_set = KineticsClips(cfg.data_root, "train", cfg.num_frames, cfg.sampling_rate, train=True)
    val_set = KineticsClips(cfg.data_root, "val", cfg.num_frames, cfg.sampling_rate, train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    val_idx = np.array_split(np.arange(len(val_set)), world)[rank].tolist()
    train_loader = DataLoader(train_set, cfg.batch_per_gpu, sampler=train_sampler, num_workers=cfg.num_workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), cfg.batch_per_gpu,
                            num_workers=cfg.num_workers, pin_memory=True)

    peak_lr = cfg.base_lr * cfg.batch_per_gpu * world / cfg.base_batch
    bn_params = [p for n, p in model.named_parameters() if "bn" in n or p.ndim == 1]
    other = [p for n, p in model.named_parameters() if not ("bn" in n or p.ndim == 1)]
    optimizer = torch.optim.SGD([{"params": bn_params, "weight_decay": 0.0},
                                 {"params": other, "weight_decay": cfg.weight_decay}],
                                lr=peak_lr, momentum=0.9, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch = 0
    ckpt_path = os.path.join(cfg.out_dir, "checkpoint.pyth")
    if os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model_state"])
        optimizer.load_state_dict(state["optimizer_state"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1
        logger.info("resumed from epoch %d", state["epoch"])

    iters = len(train_loader)
    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(train_loader):
            lr = lr_at(cfg, epoch + it / iters, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % 20 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced)
                logger.info("epoch %d iter %d/%d loss %.4f lr %.4f (%.2fs/it)", epoch, it, iters,
                            reduced.item() / world, lr, (time.time() - tic) / (it + 1))

        if rank == 0:
            os.makedirs(cfg.out_dir, exist_ok=True)
            torch.save({"epoch": epoch, "model_state": model.module.state_dict(),
                        "optimizer_state": optimizer.state_dict(), "scaler": scaler.state_dict()}, ckpt_path)
        if (epoch + 1) % cfg.eval_period == 0 or epoch + 1 == cfg.epochs:
            top1, top5 = validate(model.module, val_loader, device)
            logger.info("epoch %d val top1 %.2f top5 %.2f", epoch, top1, top5)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
