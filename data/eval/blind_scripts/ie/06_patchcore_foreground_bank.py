"""PatchCore with foreground-only memory bank, fitted and evaluated on N GPUs.

Background (conveyor belt, fixture) patches are dropped using a simple
saturation/intensity mask before they go into the bank, so every rank ends up
with a different number of patches. Scoring the test split is also sharded
over the ranks; image AUROC, pixel AUROC and PRO are computed on rank 0.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29400 patchcore_fg.py --cfg cfg/line07_gaskets.yaml
"""
import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from PIL import Image
from scipy.ndimage import gaussian_filter
from skimage import measure
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

NORM = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class InspectionSet(Dataset):
    def __init__(self, root, split, size):
        self.samples = []
        for cls_dir in sorted((root / split).iterdir()):
            for f in sorted(cls_dir.glob("*.png")):
                m = root / "ground_truth" / cls_dir.name / f"{f.stem}_mask.png"
                self.samples.append((f, m if m.exists() else None, int(cls_dir.name != "good")))
        self.size = size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        f, m, y = self.samples[i]
        img = Image.open(f).convert("RGB").resize((self.size, self.size), Image.BILINEAR)
        raw = transforms.functional.to_tensor(img)
        mask = torch.zeros(self.size, self.size, dtype=torch.bool)
        if m is not None:
            mask = torch.from_numpy(np.array(Image.open(m).resize((self.size, self.size), Image.NEAREST)) > 0)
        return NORM(raw), raw, mask, y, i


def foreground_mask(raw, grid, min_sat=0.08, min_val=0.12):
    """Coarse foreground mask on the feature grid from HSV-ish statistics of the RGB image."""
    mx, mn = raw.max(1).values, raw.min(1).values
    sat = (mx - mn) / mx.clamp_min(1e-6)
    fg = ((sat > min_sat) & (mx > min_val)).float().unsqueeze(1)
    return F.adaptive_avg_pool2d(fg, grid).squeeze(1) > 0.25


class Backbone(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        wrn = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.body = torch.nn.Sequential(wrn.conv1, wrn.bn1, wrn.relu, wrn.maxpool, wrn.layer1, wrn.layer2)
        self.layer3 = wrn.layer3
        self.dim = dim

    @torch.no_grad()
    def forward(self, x):
        f2 = self.body(x)
        f3 = self.layer3(f2)
        f3 = F.interpolate(f3, size=f2.shape[-2:], mode="bilinear", align_corners=False)
        f = torch.cat([F.avg_pool2d(f2, 3, 1, 1), F.avg_pool2d(f3, 3, 1, 1)], 1)
        b, c, h, w = f.shape
        f = F.adaptive_avg_pool1d(f.permute(0, 2, 3, 1).reshape(-1, 1, c), self.dim)
        return f.reshape(b, h, w, self.dim)


def all_gather_variable(t, world_size):
    """all_gather for tensors whose first dimension differs between ranks."""
    n = torch.tensor([t.shape[0]], device=t.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    padded = t.new_zeros((max(sizes),) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def coreset(x, n, proj=128, seed=0):
    g = torch.Generator(device=x.device).manual_seed(seed)
    z = x @ (torch.randn(x.shape[1], proj, device=x.device, generator=g) / proj ** 0.5)
    sel = [0]
    dmin = (z - z[0]).norm(dim=1)
    for _ in range(n - 1):
        i = int(dmin.argmax())
        sel.append(i)
        dmin = torch.minimum(dmin, (z - z[i]).norm(dim=1))
    return x[sel]


def pro_auc(masks, amaps, max_fpr=0.3, n_th=150):
    regions = [(k, r.coords) for k, m in enumerate(masks) for r in measure.regionprops(measure.label(m))]
    if not regions:
        return float("nan")
    neg_total = (~masks).sum()
    fpr, pro = [], []
    for th in np.linspace(amaps.max(), amaps.min(), n_th):
        b = amaps >= th
        fpr.append((b & ~masks).sum() / neg_total)
        pro.append(np.mean([b[k][c[:, 0], c[:, 1]].mean() for k, c in regions]))
    fpr, pro = np.array(fpr), np.array(pro)
    keep = fpr <= max_fpr
    return float(np.trapz(pro[keep], fpr[keep]) / max_fpr) if keep.sum() > 1 else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    root = Path(cfg["data_root"]) / cfg["line"]
    out_dir = Path(cfg["out_root"]) / cfg["line"]  # on the shared /mnt/qc volume
    size = cfg.get("size", 320)
    model = Backbone(cfg.get("dim", 1024)).to(dev).eval()

    # ---- fit ----------------------------------------------------------------
    t0 = time.time()
    train = InspectionSet(root, "train", size)
    loader = DataLoader(train, batch_size=cfg.get("batch", 16), num_workers=6, pin_memory=True,
                        sampler=DistributedSampler(train, shuffle=False))
    local = []
    for x, raw, _, _, _ in loader:
        f = model(x.to(dev, non_blocking=True))
        fg = foreground_mask(raw.to(dev), f.shape[1:3])
        local.append(f[fg])
    local = torch.cat(local)
    # per-rank coreset first so that the gather stays small
    local = coreset(local, max(1, int(len(local) * cfg["ratio"] * 4)), seed=rank)
    bank = all_gather_variable(local, world)
    bank = coreset(bank, max(1, int(len(bank) / 4)), seed=0)  # same on every rank: identical input and seed
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"bank": bank.cpu(), "cfg": cfg}, out_dir / "bank.pt")
        print(f"bank {tuple(bank.shape)} in {time.time() - t0:.0f}s")

    # ---- evaluate (sharded) ----------------------------------------------------
    test = InspectionSet(root, "test", size)
    tloader = DataLoader(test, batch_size=8, num_workers=4, sampler=DistributedSampler(test, shuffle=False))
    rows = []
    for x, _, mask, y, idx in tloader:
        f = model(x.to(dev))
        b, h, w, c = f.shape
        d = torch.cdist(f.reshape(-1, c), bank).min(1).values.reshape(b, 1, h, w)
        amap = F.interpolate(d, size=size, mode="bilinear", align_corners=False)[:, 0].cpu().numpy()
        for k in range(b):
            a = gaussian_filter(amap[k], sigma=4).astype(np.float16)
            rows.append((int(idx[k]), int(y[k]), float(a.max()), a, mask[k].numpy()))
    parts = [None] * world
    dist.all_gather_object(parts, rows)

    if rank == 0:
        uniq = {r[0]: r for part in parts for r in part}  # drop the sampler's padding repeats
        rows = [uniq[i] for i in sorted(uniq)]
        labels = np.array([r[1] for r in rows])
        scores = np.array([r[2] for r in rows])
        amaps = np.stack([r[3] for r in rows]).astype(np.float32)
        masks = np.stack([r[4] for r in rows])
        res = {"image_auroc": roc_auc_score(labels, scores),
               "pixel_auroc": roc_auc_score(masks.ravel(), amaps.ravel()),
               "pro_0.3": pro_auc(masks, amaps), "n_test": len(rows), "bank_size": len(bank)}
        print(json.dumps(res, indent=2))
        json.dump(res, open(out_dir / "metrics.json", "w"), indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
