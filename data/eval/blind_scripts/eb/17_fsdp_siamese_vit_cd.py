"""Siamese ViT-H change detection (Sentinel-2, 12 bands, 3 spectral groups)
initialised from an in-house SatMAE-style checkpoint.  ViT-H does not fit
with AdamW state on one 80 GB card, so the model is sharded with FSDP.

    torchrun --nproc_per_node=8 17_fsdp_siamese_vit_cd.py --config configs/vith_cd.yaml
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import BackwardPrefetch, FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

GROUPS = ((1, 2, 3, 7), (4, 5, 6, 8), (10, 11))   # B2-4,B8 / red edge,B8A / SWIR (indices into 12 bands)


class S2PairChips(Dataset):
    def __init__(self, root, split, train):
        self.root = os.path.join(root, split)
        self.ids = sorted(f[:-4] for f in os.listdir(self.root) if f.endswith(".npz"))
        stats = np.load(os.path.join(root, "stats.npz"))
        self.mean, self.std = stats["mean"][:, None, None], stats["std"][:, None, None]
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        z = np.load(os.path.join(self.root, self.ids[i] + ".npz"))
        a = ((z["a"] - self.mean) / self.std).astype(np.float32)
        b = ((z["b"] - self.mean) / self.std).astype(np.float32)
        y = z["y"].astype(np.int64)
        if self.train and np.random.rand() < 0.5:
            a, b, y = a[..., ::-1], b[..., ::-1], y[..., ::-1]
        return torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), torch.from_numpy(y.copy())


class GroupChannelViT(nn.Module):
    def __init__(self, img=192, patch=16, dim=1280, depth=32, heads=16):
        super().__init__()
        self.patch = patch
        self.embeds = nn.ModuleList([nn.Conv2d(len(g), dim, patch, patch) for g in GROUPS])
        n = (img // patch) ** 2
        self.pos = nn.Parameter(torch.zeros(1, 1, n, dim))
        self.group_pos = nn.Parameter(torch.zeros(1, len(GROUPS), 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        toks = torch.stack([e(x[:, list(g)]).flatten(2).transpose(1, 2) for e, g in zip(self.embeds, GROUPS)], 1)
        b, g, n, d = toks.shape
        x = (toks + self.pos + self.group_pos).reshape(b, g * n, d)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x).view(b, g, n, d).mean(1)  # (B, N, D)


class SiameseViTCD(nn.Module):
    def __init__(self, img=192, patch=16, dim=1280):
        super().__init__()
        self.encoder = GroupChannelViT(img, patch, dim)
        self.hw = img // patch
        self.head = nn.Sequential(
            nn.Conv2d(2 * dim, 256, 1), nn.GroupNorm(32, 256), nn.GELU(),
            nn.ConvTranspose2d(256, 128, 4, 4), nn.GroupNorm(16, 128), nn.GELU(),
            nn.ConvTranspose2d(128, 64, 4, 4), nn.GroupNorm(8, 64), nn.GELU(),
            nn.Conv2d(64, 2, 1))

    def forward(self, a, b):
        fa, fb = self.encoder(torch.cat([a, b], 0)).chunk(2, 0)  # one encoder pass for both dates
        f = torch.cat([fa - fb, fa * fb], -1)
        f = f.transpose(1, 2).reshape(f.shape[0], -1, self.hw, self.hw)
        return self.head(f)


def save_full_checkpoint(model, path, epoch, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "epoch": epoch}, path)


@torch.no_grad()
def evaluate(model, loader, n_total, rank, world, device):
    """All ranks run the same number of batches (FSDP); DistributedSampler's wrap-around
    duplicates are dropped by their global position."""
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    seen = 0
    for a, b, y in loader:
        bs = y.shape[0]
        pos = rank + world * torch.arange(seen, seen + bs)
        keep = (pos < n_total).to(device)
        seen += bs
        a, b, y = a.to(device), b.to(device), y.to(device)
        p = model(a, b).argmax(1) == 1
        t = y == 1
        k = keep[:, None, None]
        s += torch.stack([(p & t & k).sum(), (p & ~t & k).sum(), (~p & t & k).sum()]).double()
    dist.all_reduce(s)
    tp, fp, fn = s.tolist()
    return 2 * tp / max(1.0, 2 * tp + fp + fn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    with open(ap.parse_args().config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_ds = S2PairChips(cfg["root"], "train", True)
    val_ds = S2PairChips(cfg["root"], "val", False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, cfg["batch_size"], sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, cfg["batch_size"], sampler=val_sampler, num_workers=8, pin_memory=True)

    model = SiameseViTCD()
    if cfg.get("pretrained"):
        sd = torch.load(cfg["pretrained"], map_location="cpu")
        msg = model.encoder.load_state_dict(sd, strict=False)
        if rank == 0:
            print("pretrained:", msg, flush=True)
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 device_id=device)

    lr = cfg["lr"] * cfg["batch_size"] * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, betas=(0.9, 0.95))
    total = cfg["epochs"] * len(train_dl)
    warm = cfg.get("warmup_steps", 1000)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    cls_w = torch.tensor([1.0, cfg.get("pos_weight", 4.0)], device=device)
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (a, b, y) in enumerate(train_dl):
            a, b, y = a.to(device, non_blocking=True), b.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(a, b).float(), y, weight=cls_w, ignore_index=255)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} {step}/{len(train_dl)} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)
        f1 = evaluate(model, val_dl, len(val_ds), rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} val F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if f1 > best:
            best = f1
            save_full_checkpoint(model, os.path.join(cfg["out_dir"], "best_full.pt"), epoch, rank)
        dist.barrier()

    save_full_checkpoint(model, os.path.join(cfg["out_dir"], "final_full.pt"), cfg["epochs"] - 1, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
