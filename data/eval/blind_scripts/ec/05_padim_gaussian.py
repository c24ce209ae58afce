"""PaDiM: per-position multivariate Gaussian of patch embeddings.

Embedding = ResNet18 layer1..layer3 (448 channels), randomly reduced to 100
dims. Mean and covariance per feature-map position are accumulated over the
nominal images on all GPUs, then rank 0 fits the inverse covariances and
evaluates image AUROC / pixel AUROC / PRO on the MVTec test split.

    torchrun --nproc_per_node=8 05_padim_gaussian.py --root /datasets/mvtec --out /results/padim
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from skimage import measure
from sklearn.metrics import roc_auc_score, auc
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms as T
from torchvision.models import resnet18, ResNet18_Weights

CATEGORIES = ["bottle", "cable", "capsule", "carpet", "grid", "hazelnut", "leather", "metal_nut",
              "pill", "screw", "tile", "toothbrush", "transistor", "wood", "zipper"]


class MVTec(Dataset):
    def __init__(self, root, category, is_train, size=224):
        split = "train" if is_train else "test"
        base = os.path.join(root, category, split)
        self.items = []
        for defect in sorted(os.listdir(base)):
            for fn in sorted(os.listdir(os.path.join(base, defect))):
                if not fn.endswith(".png"):
                    continue
                mask = None if defect == "good" else os.path.join(root, category, "ground_truth", defect,
                                                                  fn.replace(".png", "_mask.png"))
                self.items.append((os.path.join(base, defect, fn), int(defect != "good"), mask))
        self.x_tf = T.Compose([T.Resize(256), T.CenterCrop(size), T.ToTensor(),
                               T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.m_tf = T.Compose([T.Resize(256, T.InterpolationMode.NEAREST), T.CenterCrop(size), T.ToTensor()])
        self.size = size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y, mpath = self.items[i]
        x = self.x_tf(Image.open(path).convert("RGB"))
        m = torch.zeros(1, self.size, self.size) if mpath is None else self.m_tf(Image.open(mpath))
        return x, y, m


class Embedder(torch.nn.Module):
    def __init__(self, n_dims=100, seed=1024):
        super().__init__()
        net = resnet18(weights=ResNet18_Weights.IMAGENET1K_V1).eval()
        self.stem = torch.nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3 = net.layer1, net.layer2, net.layer3
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("idx", torch.randperm(448, generator=g)[:n_dims])
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def forward(self, x):
        f1 = self.layer1(self.stem(x))
        f2 = self.layer2(f1)
        f3 = self.layer3(f2)
        size = f1.shape[-2:]
        emb = torch.cat([f1, F.interpolate(f2, size, mode="nearest"), F.interpolate(f3, size, mode="nearest")], 1)
        return torch.index_select(emb, 1, self.idx)


def pro_score(masks, amaps, max_fpr=0.3, steps=200):
    """Per-region overlap integrated up to max_fpr (normalised)."""
    th_lo, th_hi = amaps.min(), amaps.max()
    pros, fprs = [], []
    inv = masks == 0
    regions = [(i, r.coords) for i, m in enumerate(masks) for r in measure.regionprops(measure.label(m))]
    for th in np.linspace(th_hi, th_lo, steps):
        binary = amaps > th
        overlaps = [binary[i][c[:, 0], c[:, 1]].mean() for i, c in regions]
        fpr = np.logical_and(inv, binary).sum() / inv.sum()
        pros.append(np.mean(overlaps) if overlaps else 0.0)
        fprs.append(fpr)
        if fpr > max_fpr:
            break
    fprs, pros = np.array(fprs), np.array(pros)
    keep = fprs <= max_fpr
    return auc(fprs[keep], pros[keep]) / max_fpr if keep.sum() > 1 else 0.0


def fit_category(args, cat, model, device, rank, world):
    train = MVTec(args.root, cat, True, args.size)
    shard = Subset(train, range(rank, len(train), world))
    loader = DataLoader(shard, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    sum_x, sum_xxT, n = None, None, torch.zeros(1, dtype=torch.float64)
    for x, _, _ in loader:
        emb = model(x.to(device, non_blocking=True))  # B, C, H, W
        B, C, H, W = emb.shape
        e = emb.permute(2, 3, 0, 1).reshape(H * W, B, C).double().cpu()
        if sum_x is None:
            sum_x = torch.zeros(H * W, C, dtype=torch.float64)
            sum_xxT = torch.zeros(H * W, C, C, dtype=torch.float64)
        sum_x += e.sum(1)
        sum_xxT += torch.einsum("pbi,pbj->pij", e, e)
        n += B

    dist.all_reduce(n)
    dist.all_reduce(sum_x)
    dist.all_reduce(sum_xxT)

    mean = sum_x / n
    cov = sum_xxT / n - torch.einsum("pi,pj->pij", mean, mean)
    cov = cov * (n / (n - 1)) + 0.01 * torch.eye(cov.shape[-1], dtype=torch.float64)
    return mean.float(), cov.float(), (H, W)


@torch.no_grad()
def evaluate(args, cat, model, device, mean, cov, hw):
    test = MVTec(args.root, cat, False, args.size)
    loader = DataLoader(test, batch_size=args.batch_size, num_workers=args.workers)
    cov_inv = torch.linalg.inv(cov.to(device))
    mean = mean.to(device)
    labels, masks, maps = [], [], []
    for x, y, m in loader:
        emb = model(x.to(device))
        B, C, H, W = emb.shape
        e = emb.permute(0, 2, 3, 1).reshape(B, H * W, C) - mean[None]
        d = torch.einsum("bpi,pij,bpj->bp", e, cov_inv, e).clamp(min=0).sqrt().reshape(B, 1, H, W)
        d = F.interpolate(d, size=args.size, mode="bilinear", align_corners=False)
        maps.append(d.squeeze(1).cpu().numpy())
        labels.extend(y.tolist())
        masks.append(m.squeeze(1).numpy())
    maps = np.concatenate(maps)
    maps = np.stack([gaussian_filter(a, sigma=4) for a in maps])
    masks = (np.concatenate(masks) > 0.5).astype(np.uint8)
    img_auroc = roc_auc_score(labels, maps.reshape(len(maps), -1).max(1))
    px_auroc = roc_auc_score(masks.ravel(), maps.ravel())
    pro = pro_score(masks, maps)
    return img_auroc, px_auroc, pro


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--categories", nargs="*", default=CATEGORIES)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--dims", type=int, default=100)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = Embedder(args.dims).to(device)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for cat in args.categories:
        t0 = time.time()
        mean, cov, hw = fit_category(args, cat, model, device, rank, world)
        if rank == 0:
            with open(os.path.join(args.out, f"{cat}_gaussian.pkl"), "wb") as f:
                pickle.dump({"mean": mean.numpy(), "cov": cov.numpy(), "idx": model.idx.cpu().numpy()}, f)
            img_auroc, px_auroc, pro = evaluate(args, cat, model, device, mean, cov, hw)
            results[cat] = (img_auroc, px_auroc, pro)
            print(f"{cat:12s} img {img_auroc:.3f}  px {px_auroc:.3f}  pro {pro:.3f}  ({time.time() - t0:.0f}s)",
                  flush=True)
        dist.barrier()

    if rank == 0:
        arr = np.array(list(results.values()))
        print(f"{'mean':12s} img {arr[:, 0].mean():.3f}  px {arr[:, 1].mean():.3f}  pro {arr[:, 2].mean():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
