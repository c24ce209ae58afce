"""Memory-bank fitting for the loom-camera textile inspection.

Web images are 8192x2048 line-scan strips; we tile them into 512 px tiles at
half resolution. Tiles that are mostly off the fabric (the dark margin on the
left/right of the strip) are dropped per patch with a luminance threshold, so
only fabric patches enter the memory bank.

    torchrun --nproc_per_node=8 fit_textile_bank.py fabric=denim_3x1 output_dir=/mnt/aoi/banks
"""
import glob
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import Wide_ResNet50_2_Weights, wide_resnet50_2
from torchvision.models.feature_extraction import create_feature_extractor

DEFAULTS = OmegaConf.create({
    "data_root": "/mnt/aoi/textile",
    "fabric": "???",
    "output_dir": "/mnt/aoi/banks",
    "scale": 0.5,
    "tile": 512,
    "batch_size": 8,
    "workers": 8,
    "embed_dim": 512,
    "fg_threshold": 0.18,
    "coreset_fraction": 0.02,
    "k_nearest": 3,
})

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


class StripTiles(Dataset):
    """All tiles of all strips in a folder, indexed (strip, row, col)."""

    def __init__(self, files, scale, tile):
        self.files, self.scale, self.tile = files, scale, tile
        self.index = []
        for fi, f in enumerate(files):
            w, h = Image.open(f).size
            w, h = int(w * scale), int(h * scale)
            for r in range(h // tile):
                for c in range(w // tile):
                    self.index.append((fi, r, c))
        self._cache = (None, None)

    def __len__(self):
        return len(self.index)

    def strip(self, fi):
        if self._cache[0] != fi:
            img = Image.open(self.files[fi]).convert("RGB")
            img = img.resize((int(img.width * self.scale), int(img.height * self.scale)), Image.BILINEAR)
            self._cache = (fi, torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1))
        return self._cache[1]

    def __getitem__(self, i):
        fi, r, c = self.index[i]
        t = self.tile
        return self.strip(fi)[:, r * t:(r + 1) * t, c * t:(c + 1) * t].float() / 255.0, i


class PatchEmbedder(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        net = wide_resnet50_2(weights=Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.body = create_feature_extractor(net, {"layer2": "l2", "layer3": "l3"})
        self.dim = dim
        self.register_buffer("mean", MEAN)
        self.register_buffer("std", STD)

    @torch.no_grad()
    def forward(self, x):
        out = self.body((x - self.mean) / self.std)
        l2 = F.avg_pool2d(out["l2"], 3, 1, 1)
        l3 = F.interpolate(F.avg_pool2d(out["l3"], 3, 1, 1), size=l2.shape[-2:], mode="bilinear",
                           align_corners=False)
        f = torch.cat([l2, l3], 1)
        b, c, h, w = f.shape
        f = F.adaptive_avg_pool1d(f.permute(0, 2, 3, 1).reshape(-1, 1, c), self.dim).view(b, h, w, self.dim)
        return f


def fabric_mask(x, grid, thr):
    lum = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
    return F.adaptive_avg_pool2d(lum, grid).squeeze(1) > thr


@torch.no_grad()
def kcenter_greedy(feats, n, proj_dim=128):
    torch.manual_seed(0)
    proj = torch.nn.Linear(feats.shape[1], proj_dim, bias=False).to(feats.device)
    z = proj(feats)
    chosen = torch.empty(n, dtype=torch.long, device=feats.device)
    chosen[0] = 0
    dmin = torch.cdist(z, z[:1]).squeeze(1)
    for i in range(1, n):
        chosen[i] = torch.argmax(dmin)
        dmin = torch.minimum(dmin, torch.cdist(z, z[chosen[i]].unsqueeze(0)).squeeze(1))
    return feats[chosen]


@torch.no_grad()
def strip_score(model, bank, path, cfg, device):
    ds = StripTiles([path], cfg.scale, cfg.tile)
    worst = 0.0
    for x, _ in DataLoader(ds, batch_size=cfg.batch_size):
        x = x.to(device)
        f = model(x)
        fg = fabric_mask(x, f.shape[1:3], cfg.fg_threshold)
        if fg.any():
            d = torch.cdist(f[fg], bank).topk(cfg.k_nearest, largest=False).values.mean(1)
            worst = max(worst, d.max().item())
    return worst


def main():
    cfg = OmegaConf.merge(DEFAULTS, OmegaConf.from_cli(sys.argv[1:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    fabric_dir = os.path.join(cfg.data_root, cfg.fabric)
    train_files = sorted(glob.glob(os.path.join(fabric_dir, "train", "good", "*.png")))
    ds = StripTiles(train_files, cfg.scale, cfg.tile)
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers, pin_memory=True)
    if rank == 0:
        print(f"{cfg.fabric}: {len(train_files)} strips, {len(ds)} tiles, {math.ceil(len(ds) / world)} per rank")

    model = PatchEmbedder(cfg.embed_dim).to(device).eval()
    t0 = time.time()
    kept = []
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        f = model(x)
        fg = fabric_mask(x, f.shape[1:3], cfg.fg_threshold)
        kept.append(f[fg].half())
    local = torch.cat(kept)
    del kept

    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)

    if rank == 0:
        feats = torch.cat(gathered).float()
        n = max(1, int(len(feats) * cfg.coreset_fraction))
        bank = kcenter_greedy(feats, n)
        os.makedirs(os.path.join(cfg.output_dir, cfg.fabric), exist_ok=True)
        torch.save({"bank": bank.half().cpu(), "cfg": OmegaConf.to_container(cfg)},
                   os.path.join(cfg.output_dir, cfg.fabric, "bank.pt"))
        print(f"{len(feats)} fabric patches -> bank {tuple(bank.shape)} ({time.time() - t0:.0f}s)")

        labels, scores = [], []
        for sub in sorted(os.listdir(os.path.join(fabric_dir, "test"))):
            for p in sorted(glob.glob(os.path.join(fabric_dir, "test", sub, "*.png"))):
                scores.append(strip_score(model, bank, p, cfg, device))
                labels.append(int(sub != "good"))
        print(f"{cfg.fabric}: strip AUROC {roc_auc_score(labels, scores):.4f} ({len(labels)} strips)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
