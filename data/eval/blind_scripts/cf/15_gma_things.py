"""RAFT / GMA style trainer with Sintel + KITTI evaluation that matches evaluate.py numbers.

    torchrun --nproc_per_node=8 train.py --stage things --restore models/raft-chairs.pth --out runs/things
"""
import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from core import datasets
from core.network import RAFTGMA
from core.utils.utils import InputPadder


@dataclass
class Config:
    stage: str = "things"
    restore: Optional[str] = None
    out: str = "runs/things"
    lr: float = 1.25e-4
    wdecay: float = 1e-4
    num_steps: int = 120000
    batch_size: int = 8          # global
    image_size: List[int] = field(default_factory=lambda: [400, 720])
    iters: int = 12
    gamma: float = 0.8
    clip: float = 1.0
    mixed_precision: bool = True
    val_freq: int = 10000
    print_freq: int = 100
    num_heads: int = 1
    position_only: bool = False
    position_and_content: bool = False
    dropout: float = 0.0


def parse() -> Config:
    cfg = Config()
    p = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        if f.type == bool or f.type == "bool":
            p.add_argument("--" + f.name, action="store_true", default=getattr(cfg, f.name))
        elif f.name == "image_size":
            p.add_argument("--image_size", type=int, nargs=2, default=cfg.image_size)
        elif f.name == "restore":
            p.add_argument("--restore", default=None)
        else:
            p.add_argument("--" + f.name, type=type(getattr(cfg, f.name)), default=getattr(cfg, f.name))
    return Config(**vars(p.parse_args()))


def sequence_loss(preds, gt, valid, gamma, max_flow=400):
    mag = torch.sum(gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    n = len(preds)
    loss = 0.0
    for i in range(n):
        loss += gamma ** (n - i - 1) * (valid[:, None] * (preds[i] - gt).abs()).mean()
    return loss


@torch.no_grad()
def evaluate(model, cfg, rank, world, device):
    """Sharded Sintel evaluation; reports the same numbers as evaluate.py."""
    model.eval()
    results = {}
    for dstype in ["clean", "final"]:
        ds = datasets.MpiSintel(split="training", dstype=dstype)
        epe_list = []
        for i in range(rank, len(ds), world):
            image1, image2, flow_gt, _ = ds[i]
            image1, image2 = image1[None].to(device), image2[None].to(device)
            padder = InputPadder(image1.shape)
            image1, image2 = padder.pad(image1, image2)
            _, flow_pr = model(image1, image2, iters=32, test_mode=True)
            flow = padder.unpad(flow_pr[0]).cpu()
            epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt()
            epe_list.append(epe.view(-1).numpy())
        epe_all = np.concatenate(epe_list)
        stats = torch.tensor([epe_all.sum(), (epe_all < 1).sum(), (epe_all < 3).sum(), (epe_all < 5).sum(),
                              epe_all.size], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        n = stats[4].item()
        results[f"{dstype}_epe"] = stats[0].item() / n
        results[f"{dstype}_1px"] = stats[1].item() / n
        results[f"{dstype}_3px"] = stats[2].item() / n
        results[f"{dstype}_5px"] = stats[3].item() / n
    model.train()
    return results


def build_dataset(cfg):
    if cfg.stage == "chairs":
        aug = dict(crop_size=cfg.image_size, min_scale=-0.1, max_scale=1.0, do_flip=True)
        return datasets.FlyingChairs(aug, split="training")
    if cfg.stage == "things":
        aug = dict(crop_size=cfg.image_size, min_scale=-0.4, max_scale=0.8, do_flip=True)
        return datasets.FlyingThings3D(aug, dstype="frames_cleanpass") + \
            datasets.FlyingThings3D(aug, dstype="frames_finalpass")
    if cfg.stage == "sintel":
        aug = dict(crop_size=cfg.image_size, min_scale=-0.2, max_scale=0.6, do_flip=True)
        things = datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
        clean = datasets.MpiSintel(aug, split="training", dstype="clean")
        final = datasets.MpiSintel(aug, split="training", dstype="final")
        kitti = datasets.KITTI(dict(crop_size=cfg.image_size, min_scale=-0.3, max_scale=0.5, do_flip=True))
        hd1k = datasets.HD1K(dict(crop_size=cfg.image_size, min_scale=-0.5, max_scale=0.2, do_flip=True))
        return 100 * clean + 100 * final + 200 * kitti + 5 * hd1k + things
    raise ValueError(cfg.stage)


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    np.random.seed(1234)

    model = RAFTGMA(cfg)
    if cfg.restore:
        sd = torch.load(cfg.restore, map_location="cpu")
        model.load_state_dict({k.replace("module.", ""): v for k, v in sd.items()}, strict=False)
    model = DDP(model.to(device), device_ids=[local_rank])
    model.train()
    if cfg.stage != "chairs":
        model.module.freeze_bn()

    train_set = build_dataset(cfg)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size // world, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.lr, cfg.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.mixed_precision)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        history = open(os.path.join(cfg.out, "log.jsonl"), "a")

    step, epoch = 0, 0
    loss_acc = torch.zeros(1, device=device)
    t0 = time.time()
    while step < cfg.num_steps:
        sampler.set_epoch(epoch)
        for image1, image2, flow, valid in loader:
            image1, image2 = image1.to(device, non_blocking=True), image2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=cfg.mixed_precision):
                preds = model(image1, image2, iters=cfg.iters)
            loss = sequence_loss(preds, flow, valid, cfg.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            loss_acc += loss.detach()

            if step % cfg.print_freq == 0:
                dist.all_reduce(loss_acc)
                if rank == 0:
                    avg = loss_acc.item() / (cfg.print_freq * world)
                    print(f"step {step:6d} loss {avg:.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / cfg.print_freq:.3f}s/it", flush=True)
                    history.write(json.dumps({"step": step, "loss": avg}) + "\n")
                    history.flush()
                loss_acc.zero_()
                t0 = time.time()

            if step % cfg.val_freq == 0:
                res = evaluate(model.module, cfg, rank, world, device)
                if cfg.stage != "chairs":
                    model.module.freeze_bn()
                if rank == 0:
                    print("eval", res, flush=True)
                    history.write(json.dumps({"step": step, **res}) + "\n")
                    torch.save(model.module.state_dict(), os.path.join(cfg.out, f"{step:06d}.pth"))
            if step >= cfg.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(cfg.out, "final.pth"))
        history.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
