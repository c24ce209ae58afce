"""PatchCore with a distributed memory bank build.

Each GPU extracts locally-aware patch features for its share of the good training
images and runs greedy coreset subsampling on them; the per-GPU coresets are then
gathered into one memory bank. Scoring of the test set is done on rank 0.

    torchrun --nproc_per_node=4 02_patchcore_dist_bank.py --category bottle
"""
import argparse
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import models, transforms

log = logging.getLogger(__name__)


class MVTecFolder(Dataset):
    def __init__(self, root, category, split, resize=256, crop=224):
        base = Path(root) / category
        self.items = []
        for d in sorted((base / split).iterdir()):
            if not d.is_dir():
                continue
            for f in sorted(d.glob("*.png")):
                gt = None if d.name == "good" else base / "ground_truth" / d.name / (f.stem + "_mask.png")
                self.items.append((f, int(d.name != "good"), gt))
        self.tf = transforms.Compose([
            transforms.Resize(resize),
            transforms.CenterCrop(crop),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])
        self.tf_mask = transforms.Compose([
            transforms.Resize(resize, interpolation=transforms.InterpolationMode.NEAREST),
            transforms.CenterCrop(crop),
            transforms.ToTensor(),
        ])
        self.crop = crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, y, gt = self.items[i]
        x = self.tf(Image.open(f).convert("RGB"))
        m = torch.zeros(1, self.crop, self.crop) if gt is None else (self.tf_mask(Image.open(gt)) > 0.5).float()
        return x, m, y


class PatchFeatures(torch.nn.Module):
    """WideResNet50 layer2+layer3, 3x3 local aggregation, projected to `dim` channels."""

    def __init__(self, dim=1024):
        super().__init__()
        net = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.body = torch.nn.ModuleDict({
            "stem": torch.nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool),
            "layer1": net.layer1, "layer2": net.layer2, "layer3": net.layer3,
        })
        self.dim = dim
        self.pool = torch.nn.AvgPool2d(3, 1, 1)

    @torch.no_grad()
    def forward(self, x):
        x = self.body["stem"](x)
        x = self.body["layer1"](x)
        f2 = self.body["layer2"](x)
        f3 = self.body["layer3"](f2)
        f2 = self.pool(f2)
        f3 = F.interpolate(self.pool(f3), size=f2.shape[-2:], mode="bilinear", align_corners=False)
        feat = torch.cat([f2, f3], dim=1)  # B, 1536, H, W
        b, c, h, w = feat.shape
        feat = feat.permute(0, 2, 3, 1).reshape(-1, c)
        feat = F.adaptive_avg_pool1d(feat.unsqueeze(1), self.dim).squeeze(1)
        return feat, (h, w)


@torch.no_grad()
def greedy_coreset(feats, n_select, proj_dim=128, seed=0):
    g = torch.Generator(device=feats.device).manual_seed(seed)
    proj = torch.randn(feats.shape[1], proj_dim, device=feats.device, generator=g) / proj_dim ** 0.5
    z = feats @ proj
    start = torch.randint(len(z), (1,), device=feats.device, generator=g).item()
    selected = [start]
    min_d = torch.linalg.norm(z - z[start:start + 1], dim=1)
    for _ in range(n_select - 1):
        idx = torch.argmax(min_d).item()
        selected.append(idx)
        min_d = torch.minimum(min_d, torch.linalg.norm(z - z[idx:idx + 1], dim=1))
    return feats[torch.tensor(selected, device=feats.device)]


@torch.no_grad()
def nn_distance(query, bank, chunk=8192):
    out = []
    for i in range(0, len(query), chunk):
        d = torch.cdist(query[i:i + chunk], bank)
        out.append(d.min(dim=1).values)
    return torch.cat(out)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/datasets/mvtec_anomaly_detection")
    ap.add_argument("--category", default="bottle")
    ap.add_argument("--coreset-ratio", type=float, default=0.1)
    ap.add_argument("--feat-dim", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--out", default="results/patchcore")
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    extractor = PatchFeatures(args.feat_dim).to(dev).eval()

    train_set = MVTecFolder(args.data_root, args.category, "train")
    shard = Subset(train_set, list(range(rank, len(train_set), world)))
    loader = DataLoader(shard, batch_size=args.batch_size, num_workers=args.num_workers, pin_memory=True)

    feats = []
    for x, _, _ in loader:
        f, fmap_hw = extractor(x.to(dev, non_blocking=True))
        feats.append(f)
    feats = torch.cat(feats)
    n_keep = max(1, int(len(feats) * args.coreset_ratio))
    local_bank = greedy_coreset(feats, n_keep, seed=rank)
    log.info("local patches %d -> coreset %d", len(feats), len(local_bank))
    del feats

    gathered = [torch.empty_like(local_bank) for _ in range(world)]
    dist.all_gather(gathered, local_bank)
    memory_bank = torch.cat(gathered)
    log.info("memory bank: %s", tuple(memory_bank.shape))

    if rank == 0:
        out = Path(args.out) / args.category
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"memory_bank": memory_bank.cpu(), "feat_dim": args.feat_dim}, out / "memory_bank.pt")

        test_set = MVTecFolder(args.data_root, args.category, "test")
        test_loader = DataLoader(test_set, batch_size=args.batch_size, num_workers=args.num_workers)
        img_scores, img_labels, pix_scores, pix_labels = [], [], [], []
        for x, m, y in test_loader:
            f, (h, w) = extractor(x.to(dev))
            d = nn_distance(f, memory_bank).view(x.shape[0], 1, h, w)
            amap = F.interpolate(d, size=x.shape[-2:], mode="bilinear", align_corners=False)
            amap = amap.squeeze(1).cpu().numpy()
            amap = np.stack([gaussian_filter(a, sigma=4) for a in amap])
            img_scores.append(d.flatten(1).max(dim=1).values.cpu().numpy())
            img_labels.append(y.numpy())
            pix_scores.append(amap.reshape(-1))
            pix_labels.append(m.numpy().reshape(-1).astype(np.uint8))
        image_auroc = roc_auc_score(np.concatenate(img_labels), np.concatenate(img_scores))
        pixel_auroc = roc_auc_score(np.concatenate(pix_labels), np.concatenate(pix_scores))
        log.info("%s image AUROC %.4f pixel AUROC %.4f", args.category, image_auroc, pixel_auroc)
        with open(out / "metrics.json", "w") as fh:
            json.dump({"category": args.category, "image_auroc": image_auroc,
                       "pixel_auroc": pixel_auroc, "bank_size": len(memory_bank)}, fh, indent=2)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
