"""
Fine-tune a Sentinel-2 MAE ViT-L/8 on fMoW-Sentinel scene classification (62 classes)
with DeepSpeed ZeRO-3 (bf16).

    deepspeed --num_nodes=2 --num_gpus=8 --hostfile hostfile 17_ds_zero3_finetune.py \
        --train_csv /fsx/fmow-sentinel/train.csv --val_csv /fsx/fmow-sentinel/val.csv \
        --finetune /fsx/ckpt/mae_s2_vitl8/checkpoint-199.pth --output_dir /fsx/runs/ft_fmow_vitl
"""
import argparse
import math
import os
import time

import deepspeed
import numpy as np
import pandas as pd
import rasterio
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models.vision_transformer import VisionTransformer
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BANDS = [1, 2, 3, 4, 5, 6, 7, 8, 11, 12]  # B2..B8A, B11, B12 (1-based band index in the 13-band GeoTIFFs)
MEAN = np.array([1184.4, 1120.8, 1136.3, 1263.7, 1645.4, 1846.9, 1762.6, 1972.6, 1732.2, 1247.9], np.float32)
STD = np.array([650.3, 712.1, 965.2, 948.9, 1108.1, 1258.7, 1233.6, 1364.4, 1310.4, 1087.6], np.float32)
NUM_CLASSES = 62


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_csv", required=True)
    p.add_argument("--val_csv", required=True)
    p.add_argument("--finetune", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--input_size", type=int, default=96)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup_epochs", type=int, default=3)
    p.add_argument("--drop_path", type=float, default=0.2)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class FMoWS2(Dataset):
    def __init__(self, csv, size, train):
        self.df = pd.read_csv(csv)
        self.root = os.path.dirname(csv)
        self.size = size
        self.train = train

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        with rasterio.open(os.path.join(self.root, row["image_path"])) as src:
            x = src.read(BANDS).astype(np.float32)
        x = torch.from_numpy((x - MEAN[:, None, None]) / STD[:, None, None])
        x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        if self.train and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, int(row["category_id"])


class PaddedShard(Dataset):
    """Rank's share of the eval set, padded to equal length with flagged duplicates."""

    def __init__(self, base, rank, world):
        idx = list(range(rank, len(base), world))
        per_rank = math.ceil(len(base) / world)
        self.items = [(i, True) for i in idx] + [(idx[0], False)] * (per_rank - len(idx))
        self.base = base

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        i, real = self.items[k]
        x, y = self.base[i]
        return x, y, real


def interpolate_pos_embed(model, checkpoint_model):
    if "pos_embed" not in checkpoint_model:
        return
    pos_embed_checkpoint = checkpoint_model["pos_embed"]
    embedding_size = pos_embed_checkpoint.shape[-1]
    num_patches = model.patch_embed.num_patches
    num_extra_tokens = model.pos_embed.shape[-2] - num_patches
    orig_size = int((pos_embed_checkpoint.shape[-2] - num_extra_tokens) ** 0.5)
    new_size = int(num_patches ** 0.5)
    if orig_size != new_size:
        extra = pos_embed_checkpoint[:, :num_extra_tokens]
        pos = pos_embed_checkpoint[:, num_extra_tokens:].reshape(-1, orig_size, orig_size, embedding_size)
        pos = F.interpolate(pos.permute(0, 3, 1, 2), size=(new_size, new_size), mode="bicubic", align_corners=False)
        pos = pos.permute(0, 2, 3, 1).flatten(1, 2)
        checkpoint_model["pos_embed"] = torch.cat((extra, pos), dim=1)


def load_pretrained(model, path, is_main):
    checkpoint_model = torch.load(path, map_location="cpu")["model"]
    state_dict = model.state_dict()
    for k in ["head.weight", "head.bias"]:
        if k in checkpoint_model and checkpoint_model[k].shape != state_dict[k].shape:
            del checkpoint_model[k]
    checkpoint_model = {k: v for k, v in checkpoint_model.items() if not k.startswith("decoder") and k != "mask_token"}
    interpolate_pos_embed(model, checkpoint_model)
    msg = model.load_state_dict(checkpoint_model, strict=False)
    if is_main:
        print("missing:", msg.missing_keys)
    trunc_normal_(model.head.weight, std=2e-5)


@torch.no_grad()
def evaluate(engine, loader, device):
    engine.eval()
    stats = torch.zeros(3, device=device)  # correct, top5, count
    for x, y, real in loader:
        x, y, real = x.to(device), y.to(device), real.to(device)
        logits = engine(x.to(torch.bfloat16)).float()
        top5 = logits.topk(5, dim=1).indices
        stats[0] += ((top5[:, 0] == y) & real).sum()
        stats[1] += ((top5 == y[:, None]).any(1) & real).sum()
        stats[2] += real.sum()
    dist.all_reduce(stats)
    engine.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    train_ds = FMoWS2(args.train_csv, args.input_size, train=True)
    val_ds = FMoWS2(args.val_csv, args.input_size, train=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(PaddedShard(val_ds, rank, world), batch_size=64, num_workers=args.num_workers)

    steps_per_epoch = len(train_dl) // args.accum
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": steps_per_epoch * args.epochs,
                                 "warmup_num_steps": steps_per_epoch * args.warmup_epochs}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 200,
    }

    model = VisionTransformer(img_size=args.input_size, patch_size=8, in_chans=len(BANDS), num_classes=NUM_CLASSES,
                              embed_dim=1024, depth=24, num_heads=16, drop_path_rate=args.drop_path,
                              global_pool="avg")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    load_pretrained(engine.module, args.finetune, is_main)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x = x.to(device, non_blocking=True).to(torch.bfloat16)
            y = y.to(device, non_blocking=True)
            logits = engine(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            engine.backward(loss)
            engine.step()
        top1, top5 = evaluate(engine, val_dl, device)
        if is_main:
            print(f"epoch {epoch} top1 {top1:.4f} top5 {top5:.4f} ({time.time() - t0:.0f}s)", flush=True)
        engine.save_checkpoint(args.output_dir, tag=f"epoch{epoch:03d}", client_state={"top1": top1})
        if top1 > best:
            best = top1
            engine.save_16bit_model(args.output_dir, "best_model.bin")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
