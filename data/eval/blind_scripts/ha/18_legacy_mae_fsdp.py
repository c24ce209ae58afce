#!/usr/bin/env python
"""Masked-autoencoder pretraining of a ViT-L on DESI Legacy Survey grz cutouts.

Self-supervised backbone for the downstream morphology / photo-z heads. Model is
sharded with FSDP (ViT-L encoder + 8-block decoder, bf16 compute).

    srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 18_legacy_mae_fsdp.py --cfg mae_vitl.yaml
"""
import argparse
import functools
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from timm.models.vision_transformer import Block, PatchEmbed
from torch.distributed.fsdp import FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class LegacyCutouts(Dataset):
    def __init__(self, files, crop=144, train=True):
        self.files = files
        self.crop, self.train = crop, train
        self.index = []
        for fi, fn in enumerate(files):
            with h5py.File(fn, "r") as f:
                self.index += [(fi, j) for j in range(f["images"].shape[0])]
        self.handles = {}

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        fi, j = self.index[i]
        if fi not in self.handles:
            self.handles[fi] = h5py.File(self.files[fi], "r")
        img = torch.from_numpy(self.handles[fi]["images"][j].astype(np.float32))  # [3, 152, 152]
        img = torch.arcsinh(img / 0.01) * 0.1
        s = img.shape[-1]
        if self.train:
            y0, x0 = np.random.randint(0, s - self.crop + 1, size=2)
            img = img[:, y0:y0 + self.crop, x0:x0 + self.crop]
            img = torch.rot90(img, int(np.random.randint(4)), dims=(1, 2))
        else:
            o = (s - self.crop) // 2
            img = img[:, o:o + self.crop, o:o + self.crop]
        return img


class MAE(nn.Module):
    def __init__(self, img=144, patch=16, chans=3, dim=1024, depth=24, heads=16,
                 dec_dim=512, dec_depth=8, dec_heads=16, mask_ratio=0.75):
        super().__init__()
        self.patch, self.mask_ratio = patch, mask_ratio
        self.patch_embed = PatchEmbed(img, patch, chans, dim)
        n = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, n + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.dec_embed = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.dec_pos = nn.Parameter(torch.zeros(1, n + 1, dec_dim))
        self.dec_blocks = nn.ModuleList([Block(dec_dim, dec_heads, 4.0, qkv_bias=True) for _ in range(dec_depth)])
        self.dec_norm = nn.LayerNorm(dec_dim)
        self.dec_pred = nn.Linear(dec_dim, patch * patch * chans)
        for p in (self.cls_token, self.pos, self.mask_token, self.dec_pos):
            nn.init.trunc_normal_(p, std=0.02)

    def patchify(self, imgs):
        p = self.patch
        b, c, h, w = imgs.shape
        x = imgs.reshape(b, c, h // p, p, w // p, p)
        return torch.einsum("nchpwq->nhwpqc", x).reshape(b, (h // p) * (w // p), p * p * c)

    def forward(self, imgs):
        x = self.patch_embed(imgs) + self.pos[:, 1:]
        b, n, d = x.shape
        keep = int(n * (1 - self.mask_ratio))
        ids_shuffle = torch.argsort(torch.rand(b, n, device=x.device), dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        x = torch.gather(x, 1, ids_shuffle[:, :keep, None].expand(-1, -1, d))
        mask = torch.ones(b, n, device=x.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)

        x = torch.cat([(self.cls_token + self.pos[:, :1]).expand(b, -1, -1), x], 1)
        for blk in self.blocks:
            x = blk(x)
        x = self.dec_embed(self.norm(x))
        m = self.mask_token.expand(b, n + 1 - x.shape[1], -1)
        y = torch.cat([x[:, 1:], m], 1)
        y = torch.gather(y, 1, ids_restore[..., None].expand(-1, -1, y.shape[-1]))
        y = torch.cat([x[:, :1], y], 1) + self.dec_pos
        for blk in self.dec_blocks:
            y = blk(y)
        pred = self.dec_pred(self.dec_norm(y))[:, 1:]

        target = self.patchify(imgs)
        mu, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mu) / (var + 1e-6).sqrt()
        loss = ((pred.float() - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def lr_at(step, cfg, steps_per_epoch):
    warm = cfg["warmup_epochs"] * steps_per_epoch
    total = cfg["epochs"] * steps_per_epoch
    if step < warm:
        return cfg["lr"] * step / warm
    return cfg["min_lr"] + (cfg["lr"] - cfg["min_lr"]) * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    files = sorted(os.path.join(cfg["data_dir"], f) for f in os.listdir(cfg["data_dir"]) if f.endswith(".h5"))
    train_ds = LegacyCutouts(files[1:], cfg["crop"], train=True)
    val_ds = LegacyCutouts(files[:1], cfg["crop"], train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    # equal-length shards so every rank does the same number of FSDP forwards
    n_val = (min(len(val_ds), cfg["n_val"]) // world) * world
    val_sub = torch.utils.data.Subset(val_ds, list(range(rank, n_val, world)))
    val_dl = DataLoader(val_sub, batch_size=cfg["batch_size"], num_workers=4)

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    model = FSDP(MAE(img=cfg["crop"]), auto_wrap_policy=policy, mixed_precision=bf16,
                 device_id=local_rank, use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.05)

    out = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        print(f"{len(train_ds)} train cutouts on {world} GPUs, {len(train_dl)} steps/epoch", flush=True)

    step = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for imgs in train_dl:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg, len(train_dl))
            loss = model(imgs.to(device, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(3.0)
            opt.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} "
                      f"{(time.time() - t0) / (step - epoch * len(train_dl)):.2f}s/it", flush=True)

        model.eval()
        vl = torch.zeros(2, device=device)
        with torch.no_grad():
            for imgs in val_dl:
                vl[0] += model(imgs.to(device)) * imgs.shape[0]
                vl[1] += imgs.shape[0]
        dist.all_reduce(vl)
        if rank == 0:
            print(f"epoch {epoch} val recon loss {(vl[0] / vl[1]).item():.4f}", flush=True)

        if (epoch + 1) % cfg["save_every"] == 0 or epoch + 1 == cfg["epochs"]:
            if rank == 0:
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                          FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
                    state = model.state_dict()
                torch.save({"model": state, "epoch": epoch, "cfg": cfg},
                           os.path.join(out, f"mae_vitl_ep{epoch:03d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
