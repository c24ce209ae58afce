"""ir-CSN-152 fine-tuning on Kinetics-400 (32x2 clips) with PyTorchVideo's CSN builder.

Kinetics downloads always contain some truncated / zero-byte mp4s. Those samples come back
as None from the dataset and are dropped in the collate function.

torchrun --nproc_per_node=8 11_ircsn_kinetics_skip_corrupt.py --cfg cfgs/ircsn152_k400.json
"""
import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from pytorchvideo.models.csn import create_csn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate


@dataclass
class Config:
    train_list: str = "/data/k400/train_list.txt"
    val_list: str = "/data/k400/val_list.txt"
    video_root: str = "/data/k400/videos_320"
    pretrained: str = "/models/ircsn_152_ig65m.pyth"
    out_dir: str = "runs/ircsn152_k400"
    num_frames: int = 32
    sample_rate: int = 2
    crop: int = 224
    batch_size: int = 3
    workers: int = 8
    epochs: int = 58
    base_lr: float = 8e-4
    warmup_epochs: int = 16
    weight_decay: float = 1e-4
    milestones: list = field(default_factory=lambda: [32, 48])


class VideoList(Dataset):
    def __init__(self, cfg, list_file, train):
        self.cfg, self.train = cfg, train
        with open(list_file) as f:
            self.items = [(a, int(b)) for a, b in (l.split() for l in f)]
        self.mean = torch.tensor([110.2008, 100.63983, 95.99475]).view(3, 1, 1, 1)
        self.std = torch.tensor([58.14765, 56.46975, 55.332195]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rel, label = self.items[i]
        c = self.cfg
        try:
            vr = VideoReader(os.path.join(c.video_root, rel), ctx=cpu(0))
            n, span = len(vr), c.num_frames * c.sample_rate
            start = np.random.randint(0, max(n - span, 0) + 1) if self.train else max(n - span, 0) // 2
            idx = np.minimum(np.arange(start, start + span, c.sample_rate), n - 1)
            frames = vr.get_batch(idx).asnumpy()
        except Exception:
            return None
        x = torch.from_numpy(frames).permute(3, 0, 1, 2).float()  # C T H W, 0..255
        h, w = x.shape[-2:]
        if self.train:
            short = np.random.randint(256, 321)
        else:
            short = 256
        s = short / min(h, w)
        x = F.interpolate(x, size=(int(h * s), int(w * s)), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            y0, x0 = np.random.randint(0, h - c.crop + 1), np.random.randint(0, w - c.crop + 1)
        else:
            y0, x0 = (h - c.crop) // 2, (w - c.crop) // 2
        x = x[..., y0:y0 + c.crop, x0:x0 + c.crop]
        if self.train and np.random.rand() < 0.5:
            x = x.flip(-1)
        return (x - self.mean) / self.std, label


def collate_skip_none(batch):
    batch = [b for b in batch if b is not None]
    if len(batch) == 0:
        return None
    return default_collate(batch)


def build_model(cfg):
    model = create_csn(model_depth=152, model_num_class=400, head_pool_kernel_size=(4, 7, 7),
                       stem_conv_kernel_size=(3, 7, 7), stem_pool=nn.MaxPool3d)
    if cfg.pretrained and os.path.isfile(cfg.pretrained):
        sd = torch.load(cfg.pretrained, map_location="cpu")
        sd = sd.get("model_state", sd)
        sd = {k: v for k, v in sd.items() if not k.startswith("blocks.5.proj")}
        model.load_state_dict(sd, strict=False)
    return model


def adjust_lr(optimizer, epoch_f, cfg, lr):
    if epoch_f < cfg.warmup_epochs:
        cur = lr * (0.1 + 0.9 * epoch_f / cfg.warmup_epochs)
    else:
        cur = lr * (0.1 ** sum(epoch_f >= m for m in cfg.milestones))
    for g in optimizer.param_groups:
        g["lr"] = cur
    return cur


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="")
    cfg = Config()
    if (path := parser.parse_args().cfg):
        with open(path) as f:
            for k, v in json.load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(1000 * rank)

    train_ds, val_ds = VideoList(cfg, cfg.train_list, True), VideoList(cfg, cfg.val_list, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, cfg.batch_size, sampler=train_sampler, num_workers=cfg.workers,
                              collate_fn=collate_skip_none, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 4,
                            num_workers=cfg.workers, collate_fn=collate_skip_none, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model(cfg)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = cfg.base_lr * cfg.batch_size * world / 24
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=cfg.weight_decay)
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    n_iter = len(train_loader)
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        for it, batch in enumerate(train_loader):
            if batch is None:
                continue
            clips, labels = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            cur_lr = adjust_lr(optimizer, epoch + it / n_iter, cfg, lr)
            loss = F.cross_entropy(model(clips), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += clips.size(0)
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}/{cfg.epochs}][{it}/{n_iter}] loss {loss.item():.4f} lr {cur_lr:.2e} "
                      f"{seen / (time.time() - t0):.1f} clips/s", flush=True)

        model.eval()
        stats = torch.zeros(3, device=device)
        with torch.no_grad():
            for batch in val_loader:
                if batch is None:
                    continue
                clips, labels = batch[0].to(device), batch[1].to(device)
                top5 = model.module(clips).topk(5, 1).indices
                stats += torch.stack([(top5[:, 0] == labels).sum(), (top5 == labels[:, None]).any(1).sum(),
                                      torch.tensor(labels.numel(), device=device)]).float()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} val top1 {100 * stats[0] / stats[2]:.2f} top5 {100 * stats[1] / stats[2]:.2f} "
                  f"({int(stats[2])} videos)", flush=True)
            torch.save({"model_state": model.module.state_dict(), "optimizer_state": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(cfg.out_dir, f"epoch_{epoch:03d}.pyth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
