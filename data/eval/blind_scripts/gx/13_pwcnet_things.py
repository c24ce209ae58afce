# PWC-Net fine-tuning on FlyingThings3D (S_fine schedule), DDP version.
#
#   torchrun --nproc_per_node=4 13_pwcnet_things.py --config configs/pwc_things.yaml
#
# The config holds data roots, schedule and the checkpoint to start from.
import argparse
import logging
import os
import time
from dataclasses import dataclass, field
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from flowlib.datasets import FlyingThings3D, MpiSintel
from flowlib.models import PWCNet
from flowlib.augment import FlowAugmentor


@dataclass
class Config:
    things_root: str = "/data/FlyingThings3D"
    sintel_root: str = "/data/Sintel"
    init_ckpt: str = "checkpoints/pwc_chairs.pth"
    out_dir: str = "work/pwc_things"
    crop: List[int] = field(default_factory=lambda: [384, 768])
    batch_size: int = 4            # per GPU
    lr: float = 1e-5
    weight_decay: float = 4e-4
    epochs: int = 30
    milestones: List[int] = field(default_factory=lambda: [12, 18, 24])
    level_weights: List[float] = field(default_factory=lambda: [0.32, 0.08, 0.02, 0.01, 0.005])
    flow_scale: float = 20.0
    workers: int = 6
    log_every: int = 50
    amp: bool = False


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                if not hasattr(cfg, k):
                    raise KeyError(f"unknown config key {k}")
                setattr(cfg, k, v)
    return cfg


def robust_multiscale_loss(preds, gt, valid, weights, flow_scale, eps=0.01, q=0.4):
    """fine-tuning loss of PWC-Net: (|u|_1 + eps)^q, summed over pixels, per level."""
    gt = gt / flow_scale
    loss = 0.0
    for w, p in zip(weights, preds):
        h, wd = p.shape[-2:]
        g = F.interpolate(gt, size=(h, wd), mode="bilinear", align_corners=False)
        g = g * torch.tensor([wd / gt.shape[-1], h / gt.shape[-2]], device=gt.device).view(1, 2, 1, 1)
        v = F.interpolate(valid[:, None].float(), size=(h, wd), mode="nearest")
        diff = ((p - g).abs().sum(1, keepdim=True) + eps) ** q
        loss = loss + w * (diff * v).sum() / p.shape[0]
    return loss


@torch.no_grad()
def eval_sintel(net, root, device, rank, world, flow_scale):
    net.eval()
    out = {}
    for dstype in ("clean", "final"):
        ds = MpiSintel(root, split="training", dstype=dstype)
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        for i in range(rank, len(ds), world):
            im1, im2, gt, _ = ds[i]
            im1, im2, gt = im1[None].to(device), im2[None].to(device), gt[None].to(device)
            h, w = im1.shape[-2:]
            H, W = (h + 63) // 64 * 64, (w + 63) // 64 * 64
            im1 = F.interpolate(im1, (H, W), mode="bilinear", align_corners=False)
            im2 = F.interpolate(im2, (H, W), mode="bilinear", align_corners=False)
            flow = net(im1, im2)[-1] * flow_scale
            fh, fw = flow.shape[-2:]
            flow = F.interpolate(flow, (h, w), mode="bilinear", align_corners=False)
            flow = flow * torch.tensor([w / fw, h / fh], device=device).view(1, 2, 1, 1)
            epe = (flow - gt).norm(dim=1)
            acc[0] += epe.sum()
            acc[1] += epe.numel()
        dist.all_reduce(acc)
        out[dstype] = (acc[0] / acc[1]).item()
    net.train()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="")
    cfg = load_config(parser.parse_args().config)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    log = logging.getLogger(__name__)

    aug = FlowAugmentor(crop_size=cfg.crop, min_scale=-0.4, max_scale=0.8, do_flip=True)
    train_set = ConcatDataset([
        FlyingThings3D(cfg.things_root, dstype="frames_cleanpass", augmentor=aug),
        FlyingThings3D(cfg.things_root, dstype="frames_finalpass", augmentor=aug),
    ])
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    model = PWCNet()
    if cfg.init_ckpt:
        state = torch.load(cfg.init_ckpt, map_location="cpu")
        model.load_state_dict(state.get("model", state))
        log.info("initialised from %s", cfg.init_ckpt)
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg.milestones, gamma=0.5)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)

    writer = SummaryWriter(os.path.join(cfg.out_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        log.info("%d training pairs, %d iterations per epoch", len(train_set), len(loader))

    global_step = 0
    best_final = float("inf")
    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        for it, (im1, im2, flow, valid) in enumerate(loader):
            im1, im2 = im1.to(device, non_blocking=True), im2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)

            with torch.cuda.amp.autocast(enabled=cfg.amp):
                preds = model(im1, im2)
            loss = robust_multiscale_loss([p.float() for p in preds], flow, valid, cfg.level_weights, cfg.flow_scale)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            global_step += 1

            if global_step % cfg.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item() / world, global_step)
                    log.info("epoch %d it %d/%d loss %.3f %.2fs/it", epoch, it + 1, len(loader),
                             l.item() / world, (time.time() - t0) / (it + 1))
        scheduler.step()

        epe = eval_sintel(model.module, cfg.sintel_root, device, rank, world, cfg.flow_scale)
        if rank == 0:
            writer.add_scalar("val/sintel_clean", epe["clean"], epoch)
            writer.add_scalar("val/sintel_final", epe["final"], epoch)
            log.info("epoch %d sintel clean %.3f final %.3f", epoch, epe["clean"], epe["final"])
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pth"))
            if epe["final"] < best_final:
                best_final = epe["final"]
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
