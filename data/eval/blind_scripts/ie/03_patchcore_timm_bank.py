"""Distributed PatchCore fitting for the molded-parts lines.

Each rank embeds its shard of the nominal images with a timm backbone, the
shards are gathered and rank 0 runs the approximate greedy coreset. The
per-line bank is then scored on the held-out test split (image AUROC + PRO).

    torchrun --nnodes=1 --nproc_per_node=4 fit_patchcore.py \
        --root /data/inspection/molded --lines cap_a cap_b housing_17
"""
import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from skimage import measure
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


@dataclass
class Config:
    root: str
    out: str = "/data/inspection/banks"
    lines: List[str] = field(default_factory=list)
    backbone: str = "wide_resnet50_2"
    layers: tuple = (2, 3)
    image_size: int = 320
    crop_size: int = 288
    embed_dim: int = 1024
    coreset_ratio: float = 0.01
    batch_size: int = 16
    workers: int = 6
    knn: int = 9


class ImageFolderAD(Dataset):
    def __init__(self, root, split, cfg, with_masks=False):
        self.files, self.labels, self.masks = [], [], []
        for d in sorted((Path(root) / split).iterdir()):
            for f in sorted(d.glob("*.png")):
                self.files.append(f)
                self.labels.append(0 if d.name == "good" else 1)
                m = Path(root) / "ground_truth" / d.name / f"{f.stem}_mask.png"
                self.masks.append(m if (with_masks and m.exists()) else None)
        self.tf = transforms.Compose([
            transforms.Resize(cfg.image_size),
            transforms.CenterCrop(cfg.crop_size),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])
        self.mtf = transforms.Compose([
            transforms.Resize(cfg.image_size, interpolation=transforms.InterpolationMode.NEAREST),
            transforms.CenterCrop(cfg.crop_size),
            transforms.ToTensor(),
        ])
        self.crop = cfg.crop_size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = self.tf(Image.open(self.files[i]).convert("RGB"))
        m = self.mtf(Image.open(self.masks[i]))[0] > 0.5 if self.masks[i] else torch.zeros(self.crop, self.crop, dtype=torch.bool)
        return x, m, self.labels[i]


class Embedder(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.net = timm.create_model(cfg.backbone, pretrained=True, features_only=True, out_indices=cfg.layers)
        self.embed_dim = cfg.embed_dim

    @torch.no_grad()
    def forward(self, x):
        feats = self.net(x)
        ref = feats[0].shape[-2:]
        feats = [F.interpolate(F.avg_pool2d(f, 3, 1, 1), size=ref, mode="bilinear", align_corners=False) for f in feats]
        f = torch.cat(feats, 1)
        b, c, h, w = f.shape
        f = f.permute(0, 2, 3, 1).reshape(b * h * w, 1, c)
        f = F.adaptive_avg_pool1d(f, self.embed_dim).reshape(b, h, w, self.embed_dim)
        return f


def approx_greedy_coreset(x, n, device, proj_dim=128):
    x = x.to(device)
    torch.manual_seed(0)
    z = x @ (torch.randn(x.shape[1], proj_dim, device=device) / proj_dim ** 0.5)
    idx = [0]
    dmin = torch.linalg.norm(z - z[0], dim=1)
    for _ in range(n - 1):
        i = int(dmin.argmax())
        idx.append(i)
        dmin = torch.minimum(dmin, torch.linalg.norm(z - z[i], dim=1))
    return x[idx].cpu()


def pro_score(masks, amaps, max_fpr=0.3, steps=200):
    ths = np.linspace(amaps.min(), amaps.max(), steps)
    regions = [(i, r.coords) for i, m in enumerate(masks) for r in measure.regionprops(measure.label(m))]
    neg = ~masks
    fprs, pros = [], []
    for th in ths:
        binary = amaps > th
        pros.append(np.mean([binary[i][c[:, 0], c[:, 1]].mean() for i, c in regions]) if regions else 0.0)
        fprs.append((binary & neg).sum() / max(neg.sum(), 1))
    fprs, pros = np.array(fprs), np.array(pros)
    keep = fprs <= max_fpr
    order = np.argsort(fprs[keep])
    f, p = fprs[keep][order], pros[keep][order]
    return float(np.trapz(p, f) / max_fpr) if len(f) > 1 else 0.0


def fit_line(line, cfg, embedder, rank, world_size, device):
    root = Path(cfg.root) / line
    train_ds = ImageFolderAD(root, "train", cfg)
    sampler = DistributedSampler(train_ds, shuffle=False)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers, pin_memory=True)

    chunks = []
    for x, _, _ in loader:
        f = embedder(x.to(device, non_blocking=True))
        chunks.append(f.reshape(-1, f.shape[-1]).cpu())
    # the full patch set does not fit next to the backbone; keep it in host RAM
    local_bank = torch.cat(chunks)
    del chunks

    gathered = [torch.empty_like(local_bank) for _ in range(world_size)]
    dist.all_gather(gathered, local_bank)

    out_path = Path(cfg.out) / line / "bank.pt"
    if rank == 0:
        full = torch.cat(gathered)
        n_keep = max(1, int(len(full) * cfg.coreset_ratio))
        bank = approx_greedy_coreset(full, n_keep, device)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"bank": bank, "config": asdict(cfg), "line": line}, out_path)
        print(f"[{line}] {len(full)} patches -> {len(bank)} in bank")
    del gathered
    dist.barrier()
    return out_path


@torch.no_grad()
def evaluate_line(line, cfg, embedder, bank_path, device):
    bank = torch.load(bank_path, map_location=device)["bank"]
    test_ds = ImageFolderAD(Path(cfg.root) / line, "test", cfg, with_masks=True)
    loader = DataLoader(test_ds, batch_size=cfg.batch_size, num_workers=cfg.workers)
    scores, labels, amaps, masks = [], [], [], []
    for x, m, y in loader:
        f = embedder(x.to(device))
        b, h, w, c = f.shape
        d = torch.cdist(f.reshape(-1, c), bank).min(1).values.reshape(b, 1, h, w)
        amap = F.interpolate(d, size=cfg.crop_size, mode="bilinear", align_corners=False)[:, 0].cpu().numpy()
        for k in range(b):
            a = gaussian_filter(amap[k], sigma=4)
            amaps.append(a)
            scores.append(float(a.max()))
        masks.append(m.numpy())
        labels.extend(y.tolist())
    amaps, masks = np.stack(amaps), np.concatenate(masks)
    return {"image_auroc": roc_auc_score(labels, scores),
            "pixel_auroc": roc_auc_score(masks.ravel(), amaps.ravel()),
            "pro": pro_score(masks, amaps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="/data/inspection/banks")
    ap.add_argument("--lines", nargs="+", required=True)
    ap.add_argument("--coreset-ratio", type=float, default=0.01)
    ap.add_argument("--backbone", default="wide_resnet50_2")
    a = ap.parse_args()
    cfg = Config(root=a.root, out=a.out, lines=a.lines, coreset_ratio=a.coreset_ratio, backbone=a.backbone)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    embedder = Embedder(cfg).to(device).eval()
    summary = {}
    for line in cfg.lines:
        bank_path = fit_line(line, cfg, embedder, rank, world_size, device)
        if rank == 0:
            summary[line] = evaluate_line(line, cfg, embedder, bank_path, device)
            print(f"[{line}] " + " ".join(f"{k}={v:.4f}" for k, v in summary[line].items()))
        dist.barrier()

    if rank == 0:
        with open(Path(cfg.out) / "summary.json", "w") as f:
            json.dump(summary, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
