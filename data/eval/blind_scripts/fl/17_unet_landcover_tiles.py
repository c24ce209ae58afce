"""U-Net land-cover segmentation on large GeoTIFF scenes cut into 512x512 tiles.

The tile index is computed once (rank 0) and stored next to the data; the other ranks
wait for it. BatchNorm is synchronised because only a few tiles fit on each GPU.

    deepspeed --num_gpus 8 17_unet_landcover_tiles.py --scenes /data/landcover/scenes \
        --masks /data/landcover/masks --work-dir /data/landcover/work
"""
import argparse
import glob
import json
import os

import deepspeed
import numpy as np
import rasterio
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rasterio.windows import Window
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

TILE = 512
N_CLASSES = 7
IGNORE = 255


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--scenes", required=True)
    p.add_argument("--masks", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--encoder", default="resnet50")
    p.add_argument("--encoder-weights", default="", help="local .pth for the encoder (offline cluster)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--val-scenes", type=int, default=6)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def build_tile_index(scene_paths, mask_dir, min_valid=0.25):
    tiles = []
    for path in scene_paths:
        mask_path = os.path.join(mask_dir, os.path.basename(path))
        with rasterio.open(mask_path) as m:
            mask = m.read(1)
        h, w = mask.shape
        for y in range(0, h - TILE + 1, TILE):
            for x in range(0, w - TILE + 1, TILE):
                if (mask[y:y + TILE, x:x + TILE] != IGNORE).mean() >= min_valid:
                    tiles.append([path, mask_path, y, x])
    return tiles


def load_or_build_index(args, rank):
    index_path = os.path.join(args.work_dir, "tile_index.json")
    if rank == 0 and not os.path.exists(index_path):
        scenes = sorted(glob.glob(os.path.join(args.scenes, "*.tif")))
        val, train = scenes[: args.val_scenes], scenes[args.val_scenes:]
        index = {"train": build_tile_index(train, args.masks), "val": build_tile_index(val, args.masks)}
        os.makedirs(args.work_dir, exist_ok=True)
        with open(index_path + ".part", "w") as f:
            json.dump(index, f)
        os.replace(index_path + ".part", index_path)
    dist.barrier()
    with open(index_path) as f:
        return json.load(f)


class Tiles(Dataset):
    def __init__(self, tiles, train):
        self.tiles, self.train = tiles, train

    def __len__(self):
        return len(self.tiles)

    def __getitem__(self, i):
        img_path, mask_path, y, x = self.tiles[i]
        win = Window(x, y, TILE, TILE)
        with rasterio.open(img_path) as src:
            img = src.read([1, 2, 3, 4], window=win).astype(np.float32) / 10000.0  # B,G,R,NIR reflectance
        with rasterio.open(mask_path) as src:
            mask = src.read(1, window=win).astype(np.int64)
        if self.train:
            k = np.random.randint(4)
            img, mask = np.rot90(img, k, axes=(1, 2)), np.rot90(mask, k)
            if np.random.rand() < 0.5:
                img, mask = img[:, :, ::-1], mask[:, ::-1]
        return torch.from_numpy(img.copy()), torch.from_numpy(mask.copy())


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    index = load_or_build_index(args, rank)
    train_set, val_set = Tiles(index["train"], train=True), Tiles(index["val"], train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=11)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # Evaluation forward passes do no communication (ZeRO-2, BN in eval mode),
    # so each rank can take an unpadded, possibly shorter shard.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=8, num_workers=4)

    model = smp.Unet(args.encoder, encoder_weights=None, in_channels=4, classes=N_CLASSES)
    if args.encoder_weights:
        state = torch.load(args.encoder_weights, map_location="cpu")
        conv1 = state["conv1.weight"]
        state["conv1.weight"] = torch.cat([conv1, conv1[:, :1]], dim=1)  # RGB -> RGB+NIR
        model.encoder.load_state_dict(state, strict=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

    steps = len(train_loader) // args.accum * args.epochs
    ds_config = {
        "train_batch_size": args.batch_size * args.accum * world,
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.accum,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 1e-4}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                          "warmup_num_steps": 500, "total_num_steps": steps}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "gradient_clipping": 1.0,
    }
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    dice = smp.losses.DiceLoss("multiclass", ignore_index=IGNORE)

    ckpt_dir = os.path.join(args.work_dir, "ckpt")
    start_epoch, best_miou = 0, 0.0
    if os.path.exists(os.path.join(ckpt_dir, "latest")):
        _, client = engine.load_checkpoint(ckpt_dir)
        start_epoch, best_miou = client["epoch"] + 1, client["best_miou"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        for step, (img, mask) in enumerate(train_loader):
            img = img.to(engine.device, non_blocking=True).half()
            mask = mask.to(engine.device, non_blocking=True)
            logits = engine(img).float()
            loss = F.cross_entropy(logits, mask, ignore_index=IGNORE) + dice(logits, mask)
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        engine.eval()
        conf = torch.zeros(N_CLASSES * N_CLASSES, device=engine.device, dtype=torch.float64)
        with torch.no_grad():
            for img, mask in val_loader:
                pred = engine(img.to(engine.device).half()).argmax(1)
                mask = mask.to(engine.device)
                keep = mask != IGNORE
                conf += torch.bincount(mask[keep] * N_CLASSES + pred[keep], minlength=N_CLASSES ** 2).double()
        dist.all_reduce(conf)
        conf = conf.view(N_CLASSES, N_CLASSES)
        iou = conf.diag() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1)
        miou = iou.mean().item()
        if rank == 0:
            print(f"epoch {epoch}: mIoU {miou:.4f} per-class {[round(v, 3) for v in iou.tolist()]}", flush=True)

        improved = miou > best_miou
        best_miou = max(best_miou, miou)
        engine.save_checkpoint(ckpt_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch, "best_miou": best_miou})
        if improved and rank == 0:
            weights = {k: v.float().cpu() for k, v in engine.module.state_dict().items()}
            torch.save({"state_dict": weights, "encoder": args.encoder, "classes": N_CLASSES},
                       os.path.join(args.work_dir, "unet_best.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
