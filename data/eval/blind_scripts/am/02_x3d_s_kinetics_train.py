"""X3D-S training on Kinetics-400, 13 frames @ 160px.

torchrun --nproc_per_node=8 02_x3d_s_kinetics_train.py --config configs/x3d_s.yaml
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from pytorchvideo.models.x3d import create_x3d
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.io import read_video
from torchvision.transforms import v2 as T

logger = logging.getLogger("x3d")

DEFAULTS = {
    "data": {"root": "/datasets/kinetics400", "train_csv": "train.csv", "val_csv": "val.csv",
             "num_frames": 13, "sampling_rate": 6, "train_crop": 160, "test_crop": 160},
    "solver": {"base_lr": 0.1, "epochs": 300, "warmup_epochs": 35, "weight_decay": 5e-5,
               "momentum": 0.9, "batch_size": 4},
    "model": {"depth_factor": 2.2, "width_factor": 2.0, "bottleneck_factor": 2.25,
              "head_dim_out": 2048, "dropout": 0.5, "num_classes": 400},
    "output_dir": "runs/x3d_s",
    "num_workers": 8,
    "seed": 42,
}


def load_cfg(path):
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    if path:
        with open(path) as f:
            user = yaml.safe_load(f) or {}
        for k, v in user.items():
            if isinstance(v, dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
    return cfg


class KineticsCSV(Dataset):
    def __init__(self, root, csv_name, num_frames, rate, crop, train):
        self.root, self.num_frames, self.rate, self.train = root, num_frames, rate, train
        self.samples = []
        with open(os.path.join(root, csv_name)) as f:
            for line in f:
                rel, label = line.strip().rsplit(",", 1)
                self.samples.append((rel, int(label)))
        norm = T.Normalize(mean=[0.45, 0.45, 0.45], std=[0.225, 0.225, 0.225])
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(crop, scale=(0.25, 1.0), antialias=True),
                                 T.RandomHorizontalFlip(), norm])
        else:
            self.tf = T.Compose([T.Resize(crop, antialias=True), T.CenterCrop(crop), norm])

    def __len__(self):
        return len(self.samples)

    def _load(self, idx):
        rel, label = self.samples[idx]
        video, _, _ = read_video(os.path.join(self.root, rel), pts_unit="sec", output_format="TCHW")
        n = video.shape[0]
        if n == 0:
            raise IOError(f"empty video {rel}")
        span = self.num_frames * self.rate
        start = random.randint(0, max(n - span, 0)) if self.train else max(n - span, 0) // 2
        idx_t = torch.arange(start, start + span, self.rate).clamp_(max=n - 1)
        clip = self.tf(video[idx_t].float() / 255.0)  # T C H W
        return clip.permute(1, 0, 2, 3).contiguous(), label

    def __getitem__(self, idx):
        try:
            return self._load(idx)
        except Exception as e:  # a few hundred Kinetics files do not decode
            logger.debug("decode failed for %s: %s", self.samples[idx][0], e)
            return self._load(random.randrange(len(self.samples)))


def build_model(mcfg, dcfg):
    return create_x3d(
        input_clip_length=dcfg["num_frames"],
        input_crop_size=dcfg["train_crop"],
        model_num_class=mcfg["num_classes"],
        dropout_rate=mcfg["dropout"],
        depth_factor=mcfg["depth_factor"],
        width_factor=mcfg["width_factor"],
        bottleneck_factor=mcfg["bottleneck_factor"],
        head_dim_out=mcfg["head_dim_out"],
    )


def lr_at(epoch_float, scfg):
    base, warm, total = scfg["base_lr"], scfg["warmup_epochs"], scfg["epochs"]
    cos = base * (math.cos(math.pi * epoch_float / total) + 1.0) * 0.5
    if epoch_float < warm:
        start = 0.01 * base
        return start + (cos - start) * epoch_float / warm
    return cos


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)
    for clips, labels in loader:
        clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(clips)
        _, pred = logits.topk(5, 1)
        counts[0] += (pred[:, 0] == labels).sum()
        counts[1] += (pred == labels.unsqueeze(1)).any(1).sum()
        counts[2] += labels.size(0)
    dist.all_reduce(counts)
    return (100.0 * counts[0] / counts[2]).item(), (100.0 * counts[1] / counts[2]).item()


def save_checkpoint(path, model, optimizer, scaler, epoch, best):
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch, "best_top1": best}, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="")
    parser.add_argument("--resume", default="")
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    cfg = load_cfg(args.config)
    dcfg, scfg, mcfg = cfg["data"], cfg["solver"], cfg["model"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    train_ds = KineticsCSV(dcfg["root"], dcfg["train_csv"], dcfg["num_frames"], dcfg["sampling_rate"],
                           dcfg["train_crop"], train=True)
    val_ds = KineticsCSV(dcfg["root"], dcfg["val_csv"], dcfg["num_frames"], dcfg["sampling_rate"],
                         dcfg["test_crop"], train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    # pad-free shard per rank for validation: every val video counted exactly once
    val_idx = list(range(rank, len(val_ds), world))
    train_loader = DataLoader(train_ds, batch_size=scfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=16,
                            num_workers=cfg["num_workers"], pin_memory=True)

    model = build_model(mcfg, dcfg).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    # SGD lr is for 8 GPUs x batch 4 (32 clips); scale linearly for other sizes
    scale = world * scfg["batch_size"] / 32.0
    scfg = dict(scfg, base_lr=scfg["base_lr"] * scale)
    bn_params = [p for n, p in model.named_parameters() if "norm" in n or p.ndim == 1]
    other = [p for n, p in model.named_parameters() if not ("norm" in n or p.ndim == 1)]
    optimizer = torch.optim.SGD([{"params": other, "weight_decay": scfg["weight_decay"]},
                                 {"params": bn_params, "weight_decay": 0.0}],
                                lr=scfg["base_lr"], momentum=scfg["momentum"], nesterov=True)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.CrossEntropyLoss()

    os.makedirs(cfg["output_dir"], exist_ok=True)
    ckpt_path = os.path.join(cfg["output_dir"], "last.pth")
    start_epoch, best = 0, 0.0
    resume = args.resume or (ckpt_path if os.path.isfile(ckpt_path) else "")
    if resume:
        state = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, best = state["epoch"] + 1, state["best_top1"]
        logger.info("resumed from %s at epoch %d", resume, start_epoch)

    iters = len(train_loader)
    for epoch in range(start_epoch, scfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (clips, labels) in enumerate(train_loader):
            lr = lr_at(epoch + i / iters, scfg)
            for g in optimizer.param_groups:
                g["lr"] = lr
            clips = clips.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = criterion(model(clips), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if i % 100 == 0:
                l = reduce_mean(loss.detach())
                logger.info("epoch %d iter %d/%d loss %.4f lr %.4f", epoch, i, iters, l.item(), lr)

        if epoch % 5 == 4 or epoch == scfg["epochs"] - 1:
            top1, top5 = validate(model.module, val_loader, device)
            logger.info("epoch %d val top1 %.2f top5 %.2f", epoch, top1, top5)
            if rank == 0 and top1 > best:
                best = top1
                save_checkpoint(os.path.join(cfg["output_dir"], "best.pth"), model, optimizer, scaler, epoch, best)
        if rank == 0:
            save_checkpoint(ckpt_path, model, optimizer, scaler, epoch, best)
        dist.barrier()

    logger.info("done, best top1 %.2f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
