"""CutPaste (3-way) self-supervised representation learning with an auxiliary localisation head.

Stage 1 (epochs < --seg-warmup): classify normal / cutpaste / cutpaste-scar.
Stage 2: additionally predict the pasted region with a light segmentation head.
Evaluation: Gaussian density estimator on normal training embeddings (Mahalanobis distance).

    torchrun --nproc_per_node=4 08_cutpaste_seg.py --category wood --epochs 256
"""
import argparse
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models
from torchvision import transforms as T

NORM = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class CutPaste3Way:
    def __init__(self, area_ratio=(0.02, 0.15), aspect=(0.3, 3.3), scar_w=(2, 16), scar_h=(10, 25)):
        self.area_ratio, self.aspect = area_ratio, aspect
        self.scar_w, self.scar_h = scar_w, scar_h
        self.jitter = T.ColorJitter(0.1, 0.1, 0.1, 0.1)

    def _paste(self, img, patch, angle=0):
        w, h = img.size
        mask = Image.new("L", patch.size, 255)
        if angle:
            patch = patch.convert("RGBA").rotate(angle, expand=True)
            mask = patch.split()[-1]
            patch = patch.convert("RGB")
        x = random.randint(0, w - patch.size[0])
        y = random.randint(0, h - patch.size[1])
        out = img.copy()
        out.paste(patch, (x, y), mask)
        full = Image.new("L", img.size, 0)
        full.paste(mask, (x, y))
        return out, full

    def cutpaste(self, img):
        w, h = img.size
        area = random.uniform(*self.area_ratio) * w * h
        ar = math.exp(random.uniform(math.log(self.aspect[0]), math.log(self.aspect[1])))
        pw, ph = int(min(w - 1, math.sqrt(area * ar))), int(min(h - 1, math.sqrt(area / ar)))
        x, y = random.randint(0, w - pw), random.randint(0, h - ph)
        patch = self.jitter(img.crop((x, y, x + pw, y + ph)))
        return self._paste(img, patch)

    def scar(self, img):
        w, h = img.size
        pw, ph = random.randint(*self.scar_w), random.randint(*self.scar_h)
        x, y = random.randint(0, w - pw), random.randint(0, h - ph)
        patch = self.jitter(img.crop((x, y, x + pw, y + ph)))
        return self._paste(img, patch, angle=random.uniform(-45, 45))


class CutPasteTrainSet(Dataset):
    def __init__(self, root, category, size=256):
        self.files = sorted((Path(root) / category / "train" / "good").glob("*.png"))
        self.pre = T.Compose([T.Resize((size, size)), T.ColorJitter(0.1, 0.1, 0.1, 0.1)])
        self.aug = CutPaste3Way()
        self.to_tensor = T.Compose([T.ToTensor(), NORM])
        self.size = size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = self.pre(Image.open(self.files[i]).convert("RGB"))
        cp, cp_mask = self.aug.cutpaste(img)
        sc, sc_mask = self.aug.scar(img)
        imgs = torch.stack([self.to_tensor(im) for im in (img, cp, sc)])
        masks = torch.stack([torch.zeros(1, self.size, self.size), T.functional.to_tensor(cp_mask),
                             T.functional.to_tensor(sc_mask)])
        return imgs, (masks > 0.5).float(), torch.tensor([0, 1, 2])


class EvalSet(Dataset):
    def __init__(self, root, category, split, size=256):
        self.files = sorted((Path(root) / category / split).glob("*/*.png"))
        self.tf = T.Compose([T.Resize((size, size)), T.ToTensor(), NORM])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        f = self.files[i]
        return self.tf(Image.open(f).convert("RGB")), int(f.parent.name != "good")


class CutPasteNet(nn.Module):
    def __init__(self, head_dims=(512, 512, 512, 512, 512, 512, 512, 512, 128), num_classes=3):
        super().__init__()
        r18 = models.resnet18(weights=models.ResNet18_Weights.IMAGENET1K_V1)
        self.encoder = nn.Sequential(*list(r18.children())[:-2])  # B, 512, 8, 8
        layers, last = [], 512
        for d in head_dims:
            layers += [nn.Linear(last, d), nn.BatchNorm1d(d), nn.ReLU(inplace=True)]
            last = d
        self.head = nn.Sequential(*layers)
        self.classifier = nn.Linear(last, num_classes)
        self.seg_head = nn.Sequential(nn.Conv2d(512, 128, 3, padding=1), nn.ReLU(inplace=True),
                                      nn.Conv2d(128, 1, 1))

    def forward(self, x, with_seg=False):
        fmap = self.encoder(x)
        emb = F.adaptive_avg_pool2d(fmap, 1).flatten(1)
        logits = self.classifier(self.head(emb))
        seg = self.seg_head(fmap) if with_seg else None
        return emb, logits, seg


@torch.no_grad()
def embed(model, loader, device):
    model.eval()
    embs, labels = [], []
    for x, y in loader:
        emb, _, _ = model(x.to(device))
        embs.append(F.normalize(emb, dim=1).cpu())
        labels.append(y)
    model.train()
    return torch.cat(embs), torch.cat(labels)


def gde_scores(train_emb, test_emb, eps=1e-3):
    mean = train_emb.mean(0)
    cov = torch.cov(train_emb.T) + eps * torch.eye(train_emb.shape[1])
    inv = torch.linalg.inv(cov)
    d = test_emb - mean
    return torch.einsum("nd,dk,nk->n", d, inv, d).sqrt()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/mvtec")
    ap.add_argument("--category", default="wood")
    ap.add_argument("--epochs", type=int, default=256)
    ap.add_argument("--seg-warmup", type=int, default=64, help="epochs before the localisation head is trained")
    ap.add_argument("--seg-weight", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.03, help="per 32 images, scaled with the global batch")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/cutpaste")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(1234 + rank)
    torch.manual_seed(1234 + rank)

    train_set = CutPasteTrainSet(args.data_root, args.category)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CutPasteNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * dist.get_world_size() / 32
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=3e-5)
    steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    out_dir = Path(args.out) / args.category
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        use_seg = epoch >= args.seg_warmup
        stats = torch.zeros(3, device=device)
        for imgs, masks, labels in loader:
            imgs = imgs.flatten(0, 1).to(device, non_blocking=True)
            masks = masks.flatten(0, 1).to(device, non_blocking=True)
            labels = labels.flatten().to(device, non_blocking=True)
            _, logits, seg = model(imgs, with_seg=use_seg)
            loss = F.cross_entropy(logits, labels)
            if use_seg:
                seg = F.interpolate(seg, size=masks.shape[-2:], mode="bilinear", align_corners=False)
                loss = loss + args.seg_weight * F.binary_cross_entropy_with_logits(seg, masks)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            acc = (logits.argmax(1) == labels).float().mean()
            stats += torch.stack([loss.detach(), acc, torch.ones((), device=device)])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} loss {stats[0] / stats[2]:.4f} acc {stats[1] / stats[2]:.3f}", flush=True)

        if rank == 0 and ((epoch + 1) % 32 == 0 or epoch + 1 == args.epochs):
            net = model.module
            train_eval = DataLoader(EvalSet(args.data_root, args.category, "train"), batch_size=64, num_workers=4)
            test_eval = DataLoader(EvalSet(args.data_root, args.category, "test"), batch_size=64, num_workers=4)
            train_emb, _ = embed(net, train_eval, device)
            test_emb, test_y = embed(net, test_eval, device)
            auroc = roc_auc_score(test_y.numpy(), gde_scores(train_emb, test_emb).numpy())
            print(f"[{args.category}] epoch {epoch}: image AUROC {auroc:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch, "auroc": auroc,
                        "gde_mean": train_emb.mean(0)}, out_dir / "cutpaste.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
