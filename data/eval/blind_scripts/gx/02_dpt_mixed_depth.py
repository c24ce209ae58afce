#!/usr/bin/env python
# DPT-style relative (inverse) depth training on a mix of datasets, MiDaS recipe:
# scale-and-shift invariant loss + multi-scale gradient matching.
#
#   torchrun --nproc_per_node=8 02_dpt_mixed_depth.py --config configs/dpt_mix5.yaml
import argparse
import json
import math
import os
import time

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler, Subset
from torch.utils.tensorboard import SummaryWriter


DEFAULTS = dict(
    datasets=[],            # list of {name, root, list, weight}
    val_datasets=[],
    backbone="vit_base_patch16_384",
    features=256,
    image_size=384,
    batch_size=8,           # per GPU; the learning rates below are for 8 GPUs (global batch 64)
    lr_backbone=1e-5,
    lr_decoder=1e-4,
    weight_decay=1e-2,
    epochs=60,
    samples_per_epoch=80000,
    workers=8,
    amp=True,
    grad_ckpt=True,
    out_dir="work_dirs/dpt_mix",
    resume="",
    seed=42,
)


class DepthList(Dataset):
    """image / inverse-depth pairs listed in a text file, one 'rgb depth' per line."""

    def __init__(self, root, list_file, size, train=True):
        with open(list_file) as f:
            self.items = [line.split() for line in f if line.strip()]
        self.root, self.size, self.train = root, size, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        rgb_path, depth_path = self.items[idx]
        img = cv2.imread(os.path.join(self.root, rgb_path), cv2.IMREAD_COLOR)[:, :, ::-1].astype(np.float32) / 255.0
        disp = cv2.imread(os.path.join(self.root, depth_path), cv2.IMREAD_UNCHANGED).astype(np.float32)
        mask = (disp > 0).astype(np.float32)

        h, w = disp.shape
        scale = self.size / min(h, w)
        if self.train:
            scale *= np.random.uniform(1.0, 1.3)
        nh, nw = int(math.ceil(h * scale)), int(math.ceil(w * scale))
        img = cv2.resize(img, (nw, nh), interpolation=cv2.INTER_CUBIC)
        disp = cv2.resize(disp, (nw, nh), interpolation=cv2.INTER_NEAREST)
        mask = cv2.resize(mask, (nw, nh), interpolation=cv2.INTER_NEAREST)

        if self.train:
            y0 = np.random.randint(0, nh - self.size + 1)
            x0 = np.random.randint(0, nw - self.size + 1)
        else:
            y0, x0 = (nh - self.size) // 2, (nw - self.size) // 2
        sl = (slice(y0, y0 + self.size), slice(x0, x0 + self.size))
        img, disp, mask = img[sl], disp[sl], mask[sl]
        if self.train and np.random.rand() < 0.5:
            img, disp, mask = img[:, ::-1], disp[:, ::-1], mask[:, ::-1]

        img = (img - 0.5) / 0.5
        return (torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))),
                torch.from_numpy(np.ascontiguousarray(disp)),
                torch.from_numpy(np.ascontiguousarray(mask)))


class DistributedMixSampler(Sampler):
    """Draws a fixed number of samples per epoch with per-dataset weights.

    Every rank draws the same global index list (same generator seed) and keeps
    its own stride, so the ranks never overlap and all get the same count.
    """

    def __init__(self, sizes, weights, samples_per_epoch, rank, world_size, seed=0):
        self.sizes, self.weights = sizes, weights
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_samples = samples_per_epoch // world_size
        self.total_size = self.num_samples * world_size
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        probs = torch.cat([torch.full((n,), w / n, dtype=torch.double) for n, w in zip(self.sizes, self.weights)])
        idx = torch.multinomial(probs, self.total_size, replacement=True, generator=g)
        return iter(idx[self.rank:self.total_size:self.world_size].tolist())

    def __len__(self):
        return self.num_samples


def res_unit(features):
    return nn.Sequential(nn.ReLU(), nn.Conv2d(features, features, 3, 1, 1, bias=False), nn.BatchNorm2d(features),
                         nn.ReLU(), nn.Conv2d(features, features, 3, 1, 1, bias=False), nn.BatchNorm2d(features))


class FeatureFusionBlock(nn.Module):
    def __init__(self, features, has_skip=True):
        super().__init__()
        # the deepest block has no skip input, so it gets no res1 at all
        self.res1 = res_unit(features) if has_skip else None
        self.res2 = res_unit(features)
        self.out_conv = nn.Conv2d(features, features, 1)

    def forward(self, x, skip=None):
        if skip is not None:
            x = x + skip + self.res1(skip)
        x = x + self.res2(x)
        x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True)
        return self.out_conv(x)


class DPT(nn.Module):
    def __init__(self, backbone, features=256, hooks=(2, 5, 8, 11), grad_ckpt=False):
        super().__init__()
        self.vit = timm.create_model(backbone, pretrained=True)
        self.vit.reset_classifier(0)
        self.vit.norm = nn.Identity()      # decoder reads the hooked blocks, not the final norm
        self.hooks = hooks
        self.grad_ckpt = grad_ckpt
        dim = self.vit.embed_dim
        out_ch = [96, 192, 384, 768]
        self.reassemble = nn.ModuleList([
            nn.Sequential(nn.Conv2d(dim, out_ch[0], 1), nn.ConvTranspose2d(out_ch[0], out_ch[0], 4, 4)),
            nn.Sequential(nn.Conv2d(dim, out_ch[1], 1), nn.ConvTranspose2d(out_ch[1], out_ch[1], 2, 2)),
            nn.Conv2d(dim, out_ch[2], 1),
            nn.Sequential(nn.Conv2d(dim, out_ch[3], 1), nn.Conv2d(out_ch[3], out_ch[3], 3, 2, 1)),
        ])
        self.project = nn.ModuleList([nn.Conv2d(c, features, 3, 1, 1, bias=False) for c in out_ch])
        self.fusion = nn.ModuleList([FeatureFusionBlock(features) for _ in range(3)]
                                    + [FeatureFusionBlock(features, has_skip=False)])
        self.head = nn.Sequential(
            nn.Conv2d(features, features // 2, 3, 1, 1),
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
            nn.Conv2d(features // 2, 32, 3, 1, 1), nn.ReLU(True),
            nn.Conv2d(32, 1, 1), nn.ReLU(True))

    def forward(self, x):
        b, _, h, w = x.shape
        gh, gw = h // 16, w // 16
        t = self.vit.patch_embed(x)
        t = self.vit._pos_embed(t)
        feats = []
        for i, blk in enumerate(self.vit.blocks):
            if self.grad_ckpt and self.training:
                t = checkpoint(blk, t, use_reentrant=False)
            else:
                t = blk(t)
            if i in self.hooks:
                f = t[:, self.vit.num_prefix_tokens:].transpose(1, 2).reshape(b, -1, gh, gw)
                feats.append(f)
        layers = [p(r(f)) for f, r, p in zip(feats, self.reassemble, self.project)]
        path = self.fusion[3](layers[3])
        path = self.fusion[2](path, layers[2])
        path = self.fusion[1](path, layers[1])
        path = self.fusion[0](path, layers[0])
        return self.head(path).squeeze(1)


def scale_shift(pred, target, mask):
    a00 = (mask * pred * pred).sum((1, 2))
    a01 = (mask * pred).sum((1, 2))
    a11 = mask.sum((1, 2))
    b0 = (mask * pred * target).sum((1, 2))
    b1 = (mask * target).sum((1, 2))
    det = a00 * a11 - a01 * a01
    valid = det > 0
    s = torch.zeros_like(b0)
    t = torch.zeros_like(b1)
    s[valid] = (a11[valid] * b0[valid] - a01[valid] * b1[valid]) / det[valid]
    t[valid] = (-a01[valid] * b0[valid] + a00[valid] * b1[valid]) / det[valid]
    return s, t


def ssi_loss(pred, target, mask, alpha=0.5, scales=4):
    s, t = scale_shift(pred, target, mask)
    aligned = s.view(-1, 1, 1) * pred + t.view(-1, 1, 1)
    n = mask.sum().clamp(min=1)
    loss = (mask * (aligned - target) ** 2).sum() / (2 * n)
    diff = aligned - target
    for k in range(scales):
        step = 2 ** k
        d, m = diff[:, ::step, ::step], mask[:, ::step, ::step]
        gx = (d[:, :, 1:] - d[:, :, :-1]).abs() * (m[:, :, 1:] * m[:, :, :-1])
        gy = (d[:, 1:, :] - d[:, :-1, :]).abs() * (m[:, 1:, :] * m[:, :-1, :])
        loss = loss + alpha * (gx.sum() + gy.sum()) / m.sum().clamp(min=1)
    return loss


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)   # sum of AbsRel, number of images
    for img, disp, mask in loader:
        img, disp, mask = img.to(device), disp.to(device), mask.to(device)
        pred = net(img)
        s, t = scale_shift(pred, disp, mask)
        aligned = (s.view(-1, 1, 1) * pred + t.view(-1, 1, 1)).clamp(min=1e-3)
        absrel = ((aligned - disp).abs() / disp.clamp(min=1e-3) * mask).sum((1, 2)) / mask.sum((1, 2)).clamp(min=1)
        stats[0] += absrel.sum()
        stats[1] += img.shape[0]
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    with open(cli.config) as f:
        cfg.update(yaml.safe_load(f) or {})

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    np.random.seed(cfg["seed"] + rank)          # augmentation only
    torch.manual_seed(cfg["seed"])

    # one process per node downloads the pretrained ViT, the others read it from the hub cache
    if local_rank != 0:
        dist.barrier()
    model = DPT(cfg["backbone"], cfg["features"], grad_ckpt=cfg["grad_ckpt"])
    if local_rank == 0:
        dist.barrier()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_sets = [DepthList(d["root"], d["list"], cfg["image_size"], train=True) for d in cfg["datasets"]]
    sampler = DistributedMixSampler([len(d) for d in train_sets], [d["weight"] for d in cfg["datasets"]],
                                    cfg["samples_per_epoch"], rank, world_size, seed=cfg["seed"])
    train_loader = DataLoader(ConcatDataset(train_sets), batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True, persistent_workers=True)
    val_loaders = {}
    for d in cfg["val_datasets"]:
        ds = DepthList(d["root"], d["list"], cfg["image_size"], train=False)
        shard = Subset(ds, list(range(rank, len(ds), world_size)))
        val_loaders[d["name"]] = DataLoader(shard, batch_size=4, num_workers=4)

    vit_params = [p for n, p in model.module.named_parameters() if n.startswith("vit.")]
    dec_params = [p for n, p in model.module.named_parameters() if not n.startswith("vit.")]
    optimizer = torch.optim.AdamW([{"params": vit_params, "lr": cfg["lr_backbone"]},
                                   {"params": dec_params, "lr": cfg["lr_decoder"]}], weight_decay=cfg["weight_decay"])
    total_iters = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[cfg["lr_backbone"], cfg["lr_decoder"]],
                                                    total_steps=total_iters, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg["amp"])

    start_epoch, best = 0, float("inf")
    if cfg["resume"]:
        ckpt = torch.load(cfg["resume"], map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    writer = None
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg["out_dir"], "tb"))
        with open(os.path.join(cfg["out_dir"], "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for it, (img, disp, mask) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            disp = disp.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
                pred = model(img)
            loss = ssi_loss(pred.float(), disp, mask)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if (it + 1) % 50 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    step = epoch * len(train_loader) + it
                    writer.add_scalar("train/loss", (running[0] / running[1]).item(), step)
                    print(f"ep {epoch} it {it + 1}/{len(train_loader)} loss {(running[0] / running[1]).item():.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
                running.zero_()

        results = {name: evaluate(model.module, loader, device) for name, loader in val_loaders.items()}
        mean_absrel = float(np.mean(list(results.values()))) if results else 0.0
        if rank == 0:
            for name, v in results.items():
                writer.add_scalar(f"val/{name}_absrel", v, epoch)
            print(f"epoch {epoch} val {results}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best": min(best, mean_absrel)}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pth"))
            if mean_absrel < best:
                torch.save(state, os.path.join(cfg["out_dir"], "best.pth"))
        best = min(best, mean_absrel)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
