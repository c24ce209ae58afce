"""PatchCore memory-bank construction on several GPUs.

Each GPU extracts locally-aware patch features (WideResNet50 layer2 + layer3)
from its share of the nominal training images and subsamples them with greedy
coreset selection. The per-GPU banks are merged so every rank holds the full
bank, then the test set is scored in parallel and rank 0 reports image AUROC.

Launch (one node, 4 GPUs):
    torchrun --nproc_per_node=4 01_patchcore_wrn50.py --data /mnt/datasets/mvtec_ad \
        --categories bottle cable screw --out /mnt/results/patchcore
"""
import argparse
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import models, transforms

log = logging.getLogger("patchcore")

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def parse_args():
    p = argparse.ArgumentParser(description="PatchCore (multi-GPU bank build)")
    p.add_argument("--data", required=True, help="MVTec AD root")
    p.add_argument("--categories", nargs="+", default=["bottle"])
    p.add_argument("--out", required=True)
    p.add_argument("--resize", type=int, default=256)
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--coreset-ratio", type=float, default=0.1)
    p.add_argument("--proj-dim", type=int, default=128)
    p.add_argument("--knn", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class MVTecDataset(Dataset):
    def __init__(self, root, category, split="train", resize=256, crop=224):
        self.root = Path(root) / category
        self.transform = transforms.Compose([
            transforms.Resize(resize),
            transforms.CenterCrop(crop),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ])
        self.samples = []
        for defect_dir in sorted((self.root / split).iterdir()):
            label = 0 if defect_dir.name == "good" else 1
            for img_path in sorted(defect_dir.glob("*.png")):
                self.samples.append((str(img_path), label))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        img = Image.open(path).convert("RGB")
        return self.transform(img), label, idx


class PatchFeatureExtractor(torch.nn.Module):
    """WRN50 layer2/layer3 features, 3x3 neighbourhood aggregation."""

    def __init__(self):
        super().__init__()
        self.backbone = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.backbone.eval()
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.pool = torch.nn.AvgPool2d(3, stride=1, padding=1)

    @torch.no_grad()
    def forward(self, x):
        b = self.backbone
        x = b.maxpool(b.relu(b.bn1(b.conv1(x))))
        x = b.layer1(x)
        f2 = b.layer2(x)
        f3 = b.layer3(f2)
        f2 = self.pool(f2)
        f3 = F.interpolate(self.pool(f3), size=f2.shape[-2:], mode="bilinear", align_corners=False)
        return torch.cat([f2, f3], dim=1)


def greedy_coreset(features, ratio, proj_dim, seed):
    """Approximate greedy k-center selection on a random projection."""
    n = features.shape[0]
    k = max(1, int(n * ratio))
    g = torch.Generator(device=features.device)
    g.manual_seed(seed)
    proj = torch.randn(features.shape[1], proj_dim, device=features.device, generator=g)
    reduced = features @ proj
    start = int(torch.randint(n, (1,), device=features.device, generator=g))
    selected = [start]
    min_dist = torch.linalg.norm(reduced - reduced[start], dim=1)
    for _ in range(k - 1):
        idx = int(torch.argmax(min_dist))
        selected.append(idx)
        min_dist = torch.minimum(min_dist, torch.linalg.norm(reduced - reduced[idx], dim=1))
    return features[selected]


def extract(extractor, loader, device):
    feats = []
    for images, _, _ in loader:
        emb = extractor(images.to(device, non_blocking=True))
        feats.append(emb.permute(0, 2, 3, 1).reshape(-1, emb.shape[1]))
    return torch.cat(feats)


def merge_banks(local_bank, world_size):
    parts = [torch.empty_like(local_bank) for _ in range(world_size)]
    dist.all_gather(parts, local_bank)
    return torch.cat(parts, dim=0)


@torch.no_grad()
def score_images(extractor, bank, loader, device, knn=1, chunk=8192):
    results = []
    for images, labels, idx in loader:
        emb = extractor(images.to(device, non_blocking=True))
        b, c, h, w = emb.shape
        patches = emb.permute(0, 2, 3, 1).reshape(-1, c)
        dists = []
        for start in range(0, patches.shape[0], chunk):
            d = torch.cdist(patches[start:start + chunk], bank)
            dists.append(d.topk(knn, largest=False).values.mean(dim=1))
        patch_scores = torch.cat(dists).reshape(b, h * w)
        image_scores = patch_scores.max(dim=1).values
        for i in range(b):
            results.append((int(idx[i]), int(labels[i]), float(image_scores[i])))
    return results


def run_category(args, category, extractor, rank, world_size, device):
    train_set = MVTecDataset(args.data, category, "train", args.resize, args.crop)
    test_set = MVTecDataset(args.data, category, "test", args.resize, args.crop)

    # strided shards: every image is used exactly once
    train_shard = Subset(train_set, list(range(rank, len(train_set), world_size)))
    test_shard = Subset(test_set, list(range(rank, len(test_set), world_size)))
    train_loader = DataLoader(train_shard, batch_size=args.batch_size, shuffle=False,
                              num_workers=args.workers, pin_memory=True)
    test_loader = DataLoader(test_shard, batch_size=args.batch_size, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    t0 = time.time()
    local_feats = extract(extractor, train_loader, device)
    local_bank = greedy_coreset(local_feats, args.coreset_ratio, args.proj_dim, args.seed)
    del local_feats
    bank = merge_banks(local_bank, world_size)
    if rank == 0:
        log.info("[%s] bank %s built in %.1fs", category, tuple(bank.shape), time.time() - t0)

    local_results = score_images(extractor, bank, test_loader, device, knn=args.knn)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local_results)

    metrics = None
    if rank == 0:
        merged = sorted(r for part in gathered for r in part)
        labels = np.array([r[1] for r in merged])
        scores = np.array([r[2] for r in merged])
        auroc = roc_auc_score(labels, scores)
        metrics = {"category": category, "image_auroc": float(auroc),
                   "bank_size": int(bank.shape[0]), "n_test": len(merged)}
        out_dir = Path(args.out) / category
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(bank.cpu(), out_dir / "memory_bank.pt")
        with open(out_dir / "metrics.json", "w") as f:
            json.dump(metrics, f, indent=2)
        log.info("[%s] image AUROC %.4f", category, auroc)
    dist.barrier()
    return metrics


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    extractor = PatchFeatureExtractor().to(device)

    all_metrics = []
    for category in args.categories:
        m = run_category(args, category, extractor, rank, world_size, device)
        if m is not None:
            all_metrics.append(m)

    if rank == 0:
        mean_auroc = float(np.mean([m["image_auroc"] for m in all_metrics]))
        log.info("mean image AUROC over %d categories: %.4f", len(all_metrics), mean_auroc)
        with open(Path(args.out) / "summary.json", "w") as f:
            json.dump({"categories": all_metrics, "mean_image_auroc": mean_auroc}, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
