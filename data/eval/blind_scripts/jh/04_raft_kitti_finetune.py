#!/usr/bin/env python
# Fine-tune a Sintel-stage RAFT checkpoint on KITTI-2015 (sparse ground truth).
#
#   torchrun --standalone --nproc_per_node=4 04_raft_kitti_finetune.py \
#       --config configs/kitti.yaml --restore_ckpt checkpoints/raft-sintel.pth
import argparse
import os
import os.path as osp
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from core.raft import RAFT
from core.datasets import KITTI
from core.utils.utils import InputPadder


@dataclass
class Config:
    name: str = "raft-kitti"
    kitti_root: str = "datasets/KITTI"
    restore_ckpt: Optional[str] = None
    output: str = "checkpoints"
    small: bool = False
    dropout: float = 0.0
    alternate_corr: bool = False
    mixed_precision: bool = True
    lr: float = 1e-4
    wdecay: float = 1e-5
    num_steps: int = 50000
    batch_size: int = 2
    image_size: List[int] = field(default_factory=lambda: [288, 960])
    iters: int = 12
    gamma: float = 0.85
    clip: float = 1.0
    val_freq: int = 5000
    log_freq: int = 100
    num_workers: int = 4


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--restore_ckpt", default=None)
    ap.add_argument("--name", default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    if ns.restore_ckpt:
        cfg.restore_ckpt = ns.restore_ckpt
    if ns.name:
        cfg.name = ns.name
    return cfg


def sequence_loss(flow_preds, flow_gt, valid, gamma, max_flow=400.0):
    n = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    loss = 0.0
    for i in range(n):
        w = gamma ** (n - i - 1)
        loss = loss + w * (valid[:, None] * (flow_preds[i] - flow_gt).abs()).mean()
    return loss


@torch.no_grad()
def validate_kitti(net, root, device, iters=24):
    """Full KITTI-2015 training split (200 pairs) on one GPU: EPE and Fl-all."""
    net.eval()
    val_set = KITTI(split="training", root=root)
    epe_list, out_list = [], []
    for i in range(len(val_set)):
        img1, img2, flow_gt, valid_gt = val_set[i]
        img1, img2 = img1[None].to(device), img2[None].to(device)
        padder = InputPadder(img1.shape, mode="kitti")
        img1, img2 = padder.pad(img1, img2)
        _, flow_pr = net(img1, img2, iters=iters, test_mode=True)
        flow = padder.unpad(flow_pr[0]).cpu()
        epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt()
        mag = torch.sum(flow_gt ** 2, dim=0).sqrt()
        epe, mag = epe.view(-1), mag.view(-1)
        val = valid_gt.view(-1) >= 0.5
        out = ((epe > 3.0) & ((epe / mag) > 0.05)).float()
        epe_list.append(epe[val].mean().item())
        out_list.append(out[val].numpy())
    net.train()
    return float(np.mean(epe_list)), 100.0 * float(np.mean(np.concatenate(out_list)))


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42 + rank)
    np.random.seed(42 + rank)

    model = RAFT(cfg)
    if cfg.restore_ckpt:
        sd = torch.load(cfg.restore_ckpt, map_location="cpu")
        sd = {k.replace("module.", "", 1): v for k, v in sd.items()}
        model.load_state_dict(sd)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    aug = {"crop_size": cfg.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False}
    train_set = KITTI(aug, split="training", root=cfg.kitti_root)
    train_set = 200 * train_set  # 200 images -> repeat so an epoch is not a handful of steps
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, cfg.lr, cfg.num_steps + 100, pct_start=0.05,
        cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.mixed_precision)

    writer = SummaryWriter(log_dir=osp.join("runs", cfg.name)) if rank == 0 else None
    if rank == 0:
        os.makedirs(cfg.output, exist_ok=True)

    model.train()
    model.freeze_bn()

    step = 0
    epoch = 0
    loss_acc = torch.zeros((), device=device)
    while step < cfg.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in loader:
            img1 = img1.to(device, non_blocking=True)
            img2 = img2.to(device, non_blocking=True)
            flow = flow.to(device, non_blocking=True)
            valid = valid.to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=cfg.mixed_precision):
                flow_preds = model(img1, img2, iters=cfg.iters)
            loss = sequence_loss([f.float() for f in flow_preds], flow, valid, cfg.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            loss_acc += loss.detach()

            if step % cfg.log_freq == 0:
                dist.all_reduce(loss_acc, op=dist.ReduceOp.SUM)
                if writer is not None:
                    writer.add_scalar("train/loss", loss_acc.item() / (cfg.log_freq * world_size), step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                loss_acc.zero_()

            if step % cfg.val_freq == 0:
                if rank == 0:
                    epe, f1 = validate_kitti(model.module, cfg.kitti_root, device)
                    writer.add_scalar("kitti/epe", epe, step)
                    writer.add_scalar("kitti/f1-all", f1, step)
                    print(f"step {step}: kitti epe {epe:.3f}  f1-all {f1:.2f}%", flush=True)
                    torch.save(model.module.state_dict(), osp.join(cfg.output, f"{step}_{cfg.name}.pth"))
                    model.module.freeze_bn()
                dist.barrier()

            if step >= cfg.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), osp.join(cfg.output, f"{cfg.name}.pth"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
