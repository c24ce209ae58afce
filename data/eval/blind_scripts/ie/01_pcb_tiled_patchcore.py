#!/usr/bin/env python3
"""PatchCore memory bank for high-resolution PCB panel inspection (line 3).

Panels are ~6000x4000 px line-scan captures. We cut them into overlapping
tiles, extract mid-level WideResNet50 features per tile and keep a greedy
coreset of the patch features as the nominal memory bank. Decoding and tiling
24 MP PNGs is slow, so the tiles are cached as uint8 tensors next to the data.

    torchrun --nproc_per_node=8 build_bank.py --config configs/pcb_line3.yaml
"""
import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models

Image.MAX_IMAGE_PIXELS = None

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def tile_positions(length, tile, stride):
    pos = list(range(0, max(length - tile, 0) + 1, stride))
    if pos[-1] + tile < length:
        pos.append(length - tile)
    return pos


def tile_image(img, tile, stride):
    h, w = img.shape[:2]
    tiles, coords = [], []
    for y in tile_positions(h, tile, stride):
        for x in tile_positions(w, tile, stride):
            tiles.append(img[y:y + tile, x:x + tile])
            coords.append((y, x))
    return np.stack(tiles), coords


def load_panel(path, downscale):
    img = Image.open(path).convert("RGB")
    if downscale != 1.0:
        img = img.resize((int(img.width * downscale), int(img.height * downscale)), Image.BILINEAR)
    return np.asarray(img)


def build_tile_cache(image_dir, cache_dir, tile, stride, downscale):
    """Tile every panel once and keep a flat (file, tile) index."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    index_path = cache_dir / "index.json"
    if index_path.exists():
        with open(index_path) as f:
            return json.load(f)
    index = []
    for p in sorted(image_dir.glob("*.png")):
        out = cache_dir / f"{p.stem}.pt"
        if not out.exists():
            tiles, coords = tile_image(load_panel(p, downscale), tile, stride)
            torch.save({"tiles": torch.from_numpy(tiles), "coords": coords}, out)
        n_tiles = len(torch.load(out)["coords"])
        index.extend({"file": out.name, "tile": i} for i in range(n_tiles))
    with open(index_path, "w") as f:
        json.dump(index, f)
    return index


class TileDataset(Dataset):
    def __init__(self, cache_dir, index):
        self.cache_dir = cache_dir
        self.index = index
        self._file, self._tiles = None, None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        entry = self.index[i]
        if entry["file"] != self._file:  # index is sorted by file, so this hits most of the time
            self._tiles = torch.load(self.cache_dir / entry["file"])["tiles"]
            self._file = entry["file"]
        t = self._tiles[entry["tile"]].permute(2, 0, 1).float() / 255.0
        return t


class FeatureExtractor(torch.nn.Module):
    def __init__(self, target_dim):
        super().__init__()
        net = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.stem = torch.nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1)
        self.layer2, self.layer3 = net.layer2, net.layer3
        self.target_dim = target_dim
        self.register_buffer("mean", MEAN)
        self.register_buffer("std", STD)

    @torch.no_grad()
    def forward(self, x):
        x = (x - self.mean) / self.std
        f2 = self.layer2(self.stem(x))
        f3 = self.layer3(f2)
        f2 = F.avg_pool2d(f2, 3, 1, 1)
        f3 = F.interpolate(F.avg_pool2d(f3, 3, 1, 1), size=f2.shape[-2:], mode="bilinear", align_corners=False)
        feats = torch.cat([f2, f3], dim=1)                      # B x 1536 x h x w
        b, c, h, w = feats.shape
        feats = feats.permute(0, 2, 3, 1).reshape(-1, 1, c)
        feats = F.adaptive_avg_pool1d(feats, self.target_dim).squeeze(1)
        return feats.reshape(b, h * w, self.target_dim), (h, w)


@torch.no_grad()
def greedy_coreset(feats, n_select, proj_dim=128, seed=0):
    g = torch.Generator(device=feats.device).manual_seed(seed)
    proj = torch.randn(feats.shape[1], proj_dim, device=feats.device, generator=g) / proj_dim ** 0.5
    z = feats @ proj
    selected = [int(torch.randint(len(z), (1,), device=feats.device, generator=g))]
    min_dist = torch.cdist(z, z[selected[-1]:selected[-1] + 1]).squeeze(1)
    for _ in range(n_select - 1):
        idx = int(torch.argmax(min_dist))
        selected.append(idx)
        min_dist = torch.minimum(min_dist, torch.cdist(z, z[idx:idx + 1]).squeeze(1))
    return feats[selected]


@torch.no_grad()
def score_panel(extractor, bank, path, cfg, device):
    img = load_panel(path, cfg["downscale"])
    tiles, coords = tile_image(img, cfg["tile"], cfg["stride"])
    amap = np.zeros(img.shape[:2], dtype=np.float32)
    count = np.zeros(img.shape[:2], dtype=np.float32)
    for s in range(0, len(tiles), cfg["batch_size"]):
        x = torch.from_numpy(tiles[s:s + cfg["batch_size"]]).permute(0, 3, 1, 2).float().div(255).to(device)
        feats, (h, w) = extractor(x)
        d = torch.cdist(feats.reshape(-1, feats.shape[-1]), bank).min(dim=1).values
        d = d.reshape(-1, 1, h, w)
        d = F.interpolate(d, size=(cfg["tile"], cfg["tile"]), mode="bilinear", align_corners=False)
        for k, (y, xx) in enumerate(coords[s:s + cfg["batch_size"]]):
            amap[y:y + cfg["tile"], xx:xx + cfg["tile"]] += d[k, 0].cpu().numpy()
            count[y:y + cfg["tile"], xx:xx + cfg["tile"]] += 1
    return amap / np.maximum(count, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--skip-eval", action="store_true")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 runs the final coreset and the panel eval while the others wait
    dist.init_process_group(backend="nccl", timeout=timedelta(hours=2))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data_root = Path(cfg["data_root"]) / cfg["product_line"]
    cache_dir = Path(cfg["cache_root"]) / cfg["product_line"] / f"t{cfg['tile']}_s{cfg['stride']}_d{cfg['downscale']}"
    out_dir = Path(cfg["output_dir"]) / cfg["product_line"]

    t0 = time.time()
    index = build_tile_cache(data_root / "train" / "good", cache_dir, cfg["tile"], cfg["stride"], cfg["downscale"])
    if rank == 0:
        print(f"[line {cfg['product_line']}] {len(index)} nominal tiles ({time.time() - t0:.0f}s to index)")

    ds = TileDataset(cache_dir, index)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg.get("workers", 6),
                        pin_memory=True)

    extractor = FeatureExtractor(cfg["feature_dim"]).to(device).eval()

    local_feats = []
    for step, x in enumerate(loader):
        feats, _ = extractor(x.to(device, non_blocking=True))
        # random patch subsampling keeps the per-rank bank in GPU memory
        keep = torch.randperm(feats.shape[1], device=device)[: cfg["patches_per_tile"]]
        local_feats.append(feats[:, keep].reshape(-1, feats.shape[-1]).half())
        if rank == 0 and step % 50 == 0:
            print(f"  extract {step}/{len(loader)}")
    local_feats = torch.cat(local_feats).float()

    n_local = int(len(local_feats) * cfg["coreset_ratio"] * world_size)
    local_core = greedy_coreset(local_feats, n_local, seed=rank)
    del local_feats

    gathered = [torch.empty_like(local_core) for _ in range(world_size)]
    dist.all_gather(gathered, local_core)

    if rank == 0:
        bank = torch.cat(gathered)
        bank = greedy_coreset(bank, int(len(bank) / world_size), seed=0)
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"bank": bank.cpu(), "config": cfg}, out_dir / "memory_bank.pt")
        print(f"memory bank {tuple(bank.shape)} saved to {out_dir} ({time.time() - t0:.0f}s)")

        if not args.skip_eval:
            labels, scores = [], []
            for split_dir in sorted((data_root / "test").iterdir()):
                for p in sorted(split_dir.glob("*.png")):
                    amap = score_panel(extractor, bank, p, cfg, device)
                    scores.append(float(amap.max()))
                    labels.append(0 if split_dir.name == "good" else 1)
            auroc = roc_auc_score(labels, scores)
            print(f"panel AUROC {auroc:.4f} on {len(labels)} test panels")
            with open(out_dir / "eval.json", "w") as f:
                json.dump({"image_auroc": auroc, "n_test": len(labels)}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
