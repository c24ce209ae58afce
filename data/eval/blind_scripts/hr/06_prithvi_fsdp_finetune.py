"""Fine-tune a Prithvi-style ViT-L MAE encoder (HLS, 6 bands) for burn-scar segmentation.

The 300M-param encoder plus AdamW state does not fit comfortably next to 512x512
activations on our 40 GB cards, so the model is sharded with FSDP (one unit per
transformer block) and trained in bf16.

    torchrun --nproc_per_node=8 06_prithvi_fsdp_finetune.py \
        --data /data/hls_burn_scars --encoder-ckpt /models/prithvi/Prithvi_EO_V2_300M.pt
"""
import argparse
import functools
import glob
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HLS_MEAN = [0.0333, 0.0570, 0.0589, 0.2323, 0.1973, 0.1194]
HLS_STD = [0.0227, 0.0268, 0.0400, 0.0779, 0.0871, 0.0724]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/hls_burn_scars")
    p.add_argument("--encoder-ckpt", default="")
    p.add_argument("--out", default="/data/hls_burn_scars/runs/prithvi_vitl_fsdp")
    p.add_argument("--img-size", type=int, default=512)
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--layer-decay", type=float, default=0.9)
    return p.parse_args()


class BurnScars(Dataset):
    def __init__(self, files, crop=None, n_real=None):
        self.files, self.crop = files, crop
        # entries from n_real on are padding: read normally, every label ignored
        self.n_real = len(files) if n_real is None else n_real
        self.mean = np.array(HLS_MEAN, np.float32)[:, None, None]
        self.std = np.array(HLS_STD, np.float32)[:, None, None]

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with rasterio.open(self.files[i]) as src:
            x = src.read().astype(np.float32)
        with rasterio.open(self.files[i].replace("_merged.tif", ".mask.tif")) as src:
            y = src.read(1).astype(np.int64)
        y[y == -1] = 255
        if i >= self.n_real:
            y[:] = 255
        x = (x - self.mean) / self.std
        if self.crop:
            r, c = np.random.randint(0, x.shape[1] - self.crop + 1, size=2)
            x, y = x[:, r:r + self.crop, c:c + self.crop], y[r:r + self.crop, c:c + self.crop]
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


class ViTSeg(nn.Module):
    def __init__(self, in_ch=6, img=224, patch=16, dim=1024, depth=24, heads=16, n_cls=2):
        super().__init__()
        self.patch = patch
        self.patch_embed = nn.Conv2d(in_ch, dim, patch, patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, (img // patch) ** 2, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.neck = nn.Sequential(
            nn.ConvTranspose2d(dim, 256, 2, 2), nn.GroupNorm(32, 256), nn.GELU(),
            nn.ConvTranspose2d(256, 128, 2, 2), nn.GroupNorm(16, 128), nn.GELU(),
            nn.ConvTranspose2d(128, 64, 2, 2), nn.GroupNorm(8, 64), nn.GELU(),
            nn.ConvTranspose2d(64, 64, 2, 2), nn.GroupNorm(8, 64), nn.GELU())
        self.head = nn.Conv2d(64, n_cls, 1)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x):
        b, _, h, w = x.shape
        t = self.patch_embed(x).flatten(2).transpose(1, 2)
        if t.shape[1] != self.pos_embed.shape[1]:
            n = int(self.pos_embed.shape[1] ** 0.5)
            pe = self.pos_embed.reshape(1, n, n, -1).permute(0, 3, 1, 2)
            pe = F.interpolate(pe, size=(h // self.patch, w // self.patch), mode="bicubic", align_corners=False)
            t = t + pe.flatten(2).transpose(1, 2)
        else:
            t = t + self.pos_embed
        for blk in self.blocks:
            t = blk(t)
        t = self.norm(t).transpose(1, 2).reshape(b, -1, h // self.patch, w // self.patch)
        return self.head(self.neck(t))


def load_encoder(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = {k.replace("encoder.", ""): v for k, v in sd.items() if not k.startswith("decoder")}
    # Prithvi patch embed is 3D (T=1 here): (D, C, 1, p, p) -> (D, C, p, p)
    if "patch_embed.proj.weight" in sd:
        sd["patch_embed.weight"] = sd.pop("patch_embed.proj.weight").squeeze(2)
        sd["patch_embed.bias"] = sd.pop("patch_embed.proj.bias")
    if "pos_embed" in sd and sd["pos_embed"].shape[1] == model.pos_embed.shape[1] + 1:
        sd["pos_embed"] = sd["pos_embed"][:, 1:]
    return model.load_state_dict(sd, strict=False)


def param_groups(model, lr, decay, depth):
    groups = {}
    for n, p in model.named_parameters():
        if n.startswith("blocks."):
            layer = int(n.split(".")[1]) + 1
        elif n.startswith(("patch_embed", "pos_embed")):
            layer = 0
        else:
            layer = depth + 1
        scale = decay ** (depth + 1 - layer)
        wd = 0.0 if p.ndim == 1 or n == "pos_embed" else 0.05
        groups.setdefault((layer, wd), {"params": [], "lr": lr * scale, "weight_decay": wd})["params"].append(p)
    return list(groups.values())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_files = sorted(glob.glob(os.path.join(args.data, "training", "*_merged.tif")))
    val_files = sorted(glob.glob(os.path.join(args.data, "validation", "*_merged.tif")))
    train_ds = BurnScars(train_files, crop=args.crop)
    # FSDP runs collectives in every forward, so every rank needs the same number of val batches
    mine = val_files[rank::world]
    per_rank = -(-len(val_files) // world)
    val_ds = BurnScars(mine + [val_files[0]] * (per_rank - len(mine)), n_real=len(mine))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=4, num_workers=4)

    model = ViTSeg()
    if args.encoder_ckpt:
        res = load_encoder(model, args.encoder_ckpt)
        if rank == 0:
            print(f"encoder loaded, missing {len(res.missing_keys)}, unexpected {len(res.unexpected_keys)}")
    depth = len(model.blocks)

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        use_orig_params=True,
        limit_all_gathers=True,
    )
    groups = param_groups(model, args.lr, args.layer_decay, depth)
    for g in groups:
        g["base_lr"] = g["lr"]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999))
    total = args.epochs * len(train_dl)
    warm = 2 * len(train_dl)
    crit = nn.CrossEntropyLoss(weight=torch.tensor([0.3, 0.7], device=device), ignore_index=255)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            f = min(1.0, (step + 1) / warm) * 0.5 * (1 + np.cos(np.pi * step / total))
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * f
            loss = crit(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            step += 1
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        model.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_dl:
                pred = model(x.to(device)).argmax(1)
                y = y.to(device)
                v = y != 255
                s += torch.stack([((pred == 1) & (y == 1) & v).sum(), ((pred == 1) & (y == 0) & v).sum(),
                                  ((pred == 0) & (y == 1) & v).sum()]).double()
        dist.all_reduce(s)
        tp, fp, fn = s.tolist()
        iou = tp / max(tp + fp + fn, 1)

        if rank == 0:
            print(f"epoch {epoch:2d} loss {(run[0] / run[1]).item():.4f} burn IoU {iou:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if iou > best:
                best = iou
                cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                    state = model.state_dict()
                torch.save({"model": state, "epoch": epoch, "iou": iou}, os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
