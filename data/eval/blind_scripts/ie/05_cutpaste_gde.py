"""CutPaste self-supervised pre-training + Gaussian density estimator (GDE).

The classifier learns normal vs. cut-paste / scar augmented crops; at test
time a Gaussian is fitted to the embeddings of nominal training images and the
Mahalanobis distance is the anomaly score.

    torchrun --nproc_per_node=4 cutpaste.py --data /srv/qc/datasets/valves --line valve_body
"""
import argparse
import json
import os
import random
import time
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
from torchvision import models, transforms


class CutPaste3Way:
    """Returns (normal, cutpaste, scar) views of one image."""

    def __init__(self, area=(0.02, 0.15), aspect=0.3, scar_w=(2, 16), scar_h=(10, 25)):
        self.area, self.aspect = area, aspect
        self.scar_w, self.scar_h = scar_w, scar_h
        self.jitter = transforms.ColorJitter(0.1, 0.1, 0.1, 0.1)

    def _paste(self, img, pw, ph, rotate=False):
        w, h = img.size
        x, y = random.randint(0, w - pw), random.randint(0, h - ph)
        patch = self.jitter(img.crop((x, y, x + pw, y + ph)))
        mask = None
        if rotate:
            patch = patch.convert("RGBA").rotate(random.uniform(-45, 45), expand=True)
            mask = patch.split()[-1]
        tx, ty = random.randint(0, w - patch.size[0]), random.randint(0, h - patch.size[1])
        out = img.copy()
        out.paste(patch, (tx, ty), mask=mask)
        return out

    def __call__(self, img):
        w, h = img.size
        area = random.uniform(*self.area) * w * h
        ratio = random.choice([random.uniform(self.aspect, 1), random.uniform(1, 1 / self.aspect)])
        pw, ph = int(min(w, (area * ratio) ** 0.5)), int(min(h, (area / ratio) ** 0.5))
        cp = self._paste(img, pw, ph)
        scar = self._paste(img, random.randint(*self.scar_w), random.randint(*self.scar_h), rotate=True)
        return img, cp, scar


class TrainSet(Dataset):
    def __init__(self, root, size):
        self.files = sorted((Path(root) / "train" / "good").glob("*.png"))
        self.resize = transforms.Resize((size, size))
        self.cutpaste = CutPaste3Way()
        self.post = transforms.Compose([transforms.ToTensor(),
                                        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = self.resize(Image.open(self.files[i]).convert("RGB"))
        return torch.stack([self.post(v) for v in self.cutpaste(img)])


class EvalSet(Dataset):
    def __init__(self, root, split, size):
        self.items = []
        for d in sorted((Path(root) / split).iterdir()):
            self.items += [(f, 0 if d.name == "good" else 1) for f in sorted(d.glob("*.png"))]
        self.tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, y = self.items[i]
        return self.tf(Image.open(f).convert("RGB")), y


class CutPasteNet(nn.Module):
    def __init__(self, n_classes=3, head_dims=(512, 512, 512, 512, 512, 512, 512, 512, 128)):
        super().__init__()
        self.backbone = models.resnet18(weights=models.ResNet18_Weights.IMAGENET1K_V1)
        self.backbone.fc = nn.Identity()
        layers, last = [], 512
        for d in head_dims:
            layers += [nn.Linear(last, d), nn.BatchNorm1d(d), nn.ReLU(inplace=True)]
            last = d
        self.head = nn.Sequential(*layers)
        self.out = nn.Linear(last, n_classes)

    def forward(self, x):
        emb = self.backbone(x)
        return emb, self.out(self.head(emb))


@torch.no_grad()
def embed(model, loader, device):
    model.eval()
    embs, ys = [], []
    for x, y in loader:
        e, _ = model(x.to(device, non_blocking=True))
        embs.append(F.normalize(e, dim=1))
        ys.append(y.to(device))
    model.train()
    return torch.cat(embs), torch.cat(ys)


def fit_gde(train_emb):
    mean = train_emb.mean(0)
    cov = torch.cov(train_emb.T) + 0.1 * torch.eye(train_emb.shape[1], device=train_emb.device)  # shrinkage
    return mean, torch.linalg.inv(cov)


def mahalanobis(emb, mean, inv_cov):
    d = emb - mean
    return torch.sqrt(torch.einsum("nd,dk,nk->n", d, inv_cov, d).clamp_min(0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--line", required=True)
    ap.add_argument("--out", default="/srv/qc/models/cutpaste")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64, help="global, in images (x3 views)")
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--eval-every", type=int, default=16)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    root = Path(args.data) / args.line
    out_dir = Path(args.out) / args.line
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    train_ds = TrainSet(root, args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    # nominal train images for the density, and the labelled test split
    gde_ds, test_ds = EvalSet(root, "train", args.size), EvalSet(root, "test", args.size)
    gde_loader = DataLoader(gde_ds, batch_size=32, sampler=DistributedSampler(gde_ds, shuffle=False, drop_last=True),
                            num_workers=4)
    test_loader = DataLoader(test_ds, batch_size=32, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CutPasteNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=3e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)

    best_auroc, history = 0.0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, loss_sum = time.time(), torch.zeros(1, device=device)
        for views in loader:
            b = views.shape[0]
            x = views.to(device, non_blocking=True).flatten(0, 1)             # (b*3, C, H, W)
            y = torch.arange(3, device=device).repeat(b)
            _, logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        scheduler.step()
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch} loss {loss_sum.item() / (world * len(loader)):.4f} ({time.time() - t0:.0f}s)")

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            train_emb, _ = embed(model.module, gde_loader, device)
            gathered = [torch.empty_like(train_emb) for _ in range(world)]
            dist.all_gather(gathered, train_emb)
            mean, inv_cov = fit_gde(torch.cat(gathered))

            test_emb, test_y = embed(model.module, test_loader, device)
            scores = mahalanobis(test_emb, mean, inv_cov)
            auroc = roc_auc_score(test_y.cpu().numpy(), scores.cpu().numpy())
            if rank == 0:
                history.append({"epoch": epoch, "image_auroc": auroc})
                print(f"epoch {epoch} image AUROC {auroc:.4f}")
                if auroc > best_auroc:
                    best_auroc = auroc
                    torch.save({"model": model.module.state_dict(), "gde_mean": mean.cpu(),
                                "gde_inv_cov": inv_cov.cpu(), "epoch": epoch}, out_dir / "best.pt")
            dist.barrier()

    if rank == 0:
        with open(out_dir / "history.json", "w") as f:
            json.dump({"best_image_auroc": best_auroc, "history": history}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
