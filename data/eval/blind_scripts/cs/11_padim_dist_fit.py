"""PaDiM (Patch Distribution Modeling) with data-parallel statistics fitting.

Every GPU embeds its share of the normal training images; per-position first and second
moments are summed across GPUs, so the fitted Gaussians are exactly the single-GPU ones.

    torchrun --nproc_per_node=4 11_padim_dist_fit.py --categories bottle cable capsule
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
from PIL import Image
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import models, transforms as T

MVTEC_CATEGORIES = ["bottle", "cable", "capsule", "carpet", "grid", "hazelnut", "leather", "metal_nut",
                    "pill", "screw", "tile", "toothbrush", "transistor", "wood", "zipper"]


class MVTecDataset(Dataset):
    def __init__(self, root, category, is_train, resize=256, cropsize=224):
        phase = "train" if is_train else "test"
        base = os.path.join(root, category)
        self.x, self.y, self.mask = [], [], []
        for defect in sorted(os.listdir(os.path.join(base, phase))):
            d = os.path.join(base, phase, defect)
            for f in sorted(os.listdir(d)):
                if not f.endswith(".png"):
                    continue
                self.x.append(os.path.join(d, f))
                self.y.append(int(defect != "good"))
                self.mask.append(None if defect == "good" else
                                 os.path.join(base, "ground_truth", defect, f[:-4] + "_mask.png"))
        self.tf_x = T.Compose([T.Resize(resize, Image.LANCZOS), T.CenterCrop(cropsize), T.ToTensor(),
                               T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.tf_m = T.Compose([T.Resize(resize, Image.NEAREST), T.CenterCrop(cropsize), T.ToTensor()])
        self.cropsize = cropsize

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.tf_x(Image.open(self.x[i]).convert("RGB"))
        m = torch.zeros(1, self.cropsize, self.cropsize) if self.mask[i] is None else self.tf_m(Image.open(self.mask[i]))
        return x, self.y[i], m


class Embedder(torch.nn.Module):
    def __init__(self, d_reduced, seed=1024):
        super().__init__()
        net = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.stem = torch.nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3 = net.layer1, net.layer2, net.layer3
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("idx", torch.randperm(256 + 512 + 1024, generator=g)[:d_reduced])

    @torch.no_grad()
    def forward(self, x):
        f1 = self.layer1(self.stem(x))
        f2 = self.layer2(f1)
        f3 = self.layer3(f2)
        size = f1.shape[-2:]
        emb = torch.cat([f1, F.interpolate(f2, size=size, mode="nearest"),
                         F.interpolate(f3, size=size, mode="nearest")], dim=1)
        return torch.index_select(emb, 1, self.idx)  # B, d, H, W


@torch.no_grad()
def fit(embedder, dataset, device, batch_size, rank, world):
    shard = Subset(dataset, range(rank, len(dataset), world))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=4, pin_memory=True)
    s1 = s2 = None
    n = torch.zeros((), device=device, dtype=torch.float64)
    for x, _, _ in loader:
        e = embedder(x.to(device, non_blocking=True)).double()  # B, d, H, W
        b, d, h, w = e.shape
        e = e.permute(2, 3, 0, 1).reshape(h * w, b, d)       # HW, B, d
        if s1 is None:
            s1 = torch.zeros(h * w, d, device=device, dtype=torch.float64)
            s2 = torch.zeros(h * w, d, d, device=device, dtype=torch.float64)
        s1 += e.sum(1)
        s2 += torch.bmm(e.transpose(1, 2), e)
        n += b
    dist.all_reduce(s1)
    dist.all_reduce(s2)
    dist.all_reduce(n)
    mean = s1 / n
    cov = (s2 - n * torch.einsum("pi,pj->pij", mean, mean)) / (n - 1)
    cov += 0.01 * torch.eye(cov.shape[-1], device=device, dtype=cov.dtype)
    return mean.float(), torch.linalg.inv(cov).float(), (h, w)


@torch.no_grad()
def evaluate(embedder, dataset, stats, device, batch_size):
    mean, cov_inv, (h, w) = stats["mean"].to(device), stats["cov_inv"].to(device), stats["hw"]
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=4)
    scores, labels, masks = [], [], []
    for x, y, m in loader:
        e = embedder(x.to(device))
        b, d = e.shape[:2]
        delta = e.permute(2, 3, 0, 1).reshape(h * w, b, d) - mean[:, None]
        dist_map = torch.sqrt(torch.einsum("pbi,pij,pbj->pb", delta, cov_inv, delta).clamp_min(0))
        dist_map = dist_map.T.reshape(b, 1, h, w)
        dist_map = F.interpolate(dist_map, size=x.shape[-2:], mode="bilinear", align_corners=False)
        scores.append(np.stack([gaussian_filter(s, sigma=4) for s in dist_map.squeeze(1).cpu().numpy()]))
        labels.append(y.numpy())
        masks.append(m.squeeze(1).numpy())
    scores, labels, masks = np.concatenate(scores), np.concatenate(labels), np.concatenate(masks)
    img_auc = roc_auc_score(labels, scores.reshape(len(scores), -1).max(1))
    pix_auc = roc_auc_score((masks > 0.5).astype(np.uint8).ravel(), scores.ravel())
    return img_auc, pix_auc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_path", default="/mnt/shared/mvtec_anomaly_detection")
    ap.add_argument("--save_path", default="/mnt/shared/padim_results")
    ap.add_argument("--categories", nargs="+", default=MVTEC_CATEGORIES)
    ap.add_argument("--d_reduced", type=int, default=550)
    ap.add_argument("--batch_size", type=int, default=32)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    embedder = Embedder(args.d_reduced).to(device).eval()
    save_dir = Path(args.save_path) / f"wrn50_d{args.d_reduced}"
    save_dir.mkdir(parents=True, exist_ok=True)

    results = {}
    for category in args.categories:
        t0 = time.time()
        train_set = MVTecDataset(args.data_path, category, is_train=True)
        mean, cov_inv, hw = fit(embedder, train_set, device, args.batch_size, rank, world)
        stats_file = save_dir / f"{category}_stats.pt"
        torch.save({"mean": mean.cpu(), "cov_inv": cov_inv.cpu(), "hw": hw, "idx": embedder.idx.cpu()},
                   stats_file)
        del mean, cov_inv
        torch.cuda.empty_cache()

        if rank == 0:
            stats = torch.load(stats_file, map_location="cpu")
            test_set = MVTecDataset(args.data_path, category, is_train=False)
            img_auc, pix_auc = evaluate(embedder, test_set, stats, device, args.batch_size)
            results[category] = {"image_auroc": img_auc, "pixel_auroc": pix_auc}
            print(f"{category:12s} image AUROC {img_auc:.4f}  pixel AUROC {pix_auc:.4f}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()

    if rank == 0:
        results["mean"] = {k: float(np.mean([r[k] for r in results.values()])) for k in ("image_auroc", "pixel_auroc")}
        with open(save_dir / "results.json", "w") as f:
            json.dump(results, f, indent=2)
        print(json.dumps(results["mean"], indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
