"""One model for all MVTec categories: reverse-distillation student with per-category adapters.

A shared bottleneck + decoder is trained on the good images of all 15 categories at once; a
light 1x1 adapter per category is applied to the bottleneck code of the samples of that
category. Evaluation shards the whole test set over the GPUs, gathers every score back and
reports image / pixel AUROC per category.

    torchrun --nproc_per_node=8 20_multiclass_rd_eval.py --data /data/mvtec_ad --epochs 200
"""
import argparse
import os
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
from torchvision import models, transforms as T

CATEGORIES = ["bottle", "cable", "capsule", "carpet", "grid", "hazelnut", "leather", "metal_nut", "pill",
              "screw", "tile", "toothbrush", "transistor", "wood", "zipper"]
SIZE = 256
EVAL_STRIDE = 4  # pixel AUROC on every 4th pixel in each direction


class AllCategories(Dataset):
    def __init__(self, root, split):
        self.items = []
        for ci, cat in enumerate(CATEGORIES):
            base = Path(root) / cat
            for f in sorted((base / split).glob("*/*.png")):
                gt = None if f.parent.name == "good" else base / "ground_truth" / f.parent.name / f"{f.stem}_mask.png"
                self.items.append((f, ci, gt))
        self.tf = T.Compose([T.Resize((SIZE, SIZE)), T.ToTensor(),
                             T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.mtf = T.Compose([T.Resize((SIZE, SIZE), T.InterpolationMode.NEAREST), T.ToTensor()])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, ci, gt = self.items[i]
        x = self.tf(Image.open(f).convert("RGB"))
        m = torch.zeros(1, SIZE, SIZE) if gt is None else (self.mtf(Image.open(gt)) > 0.5).float()
        return x, m, int(gt is not None), ci, i


class Teacher(nn.Module):
    def __init__(self):
        super().__init__()
        n = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.stem = nn.Sequential(n.conv1, n.bn1, n.relu, n.maxpool)
        self.l1, self.l2, self.l3 = n.layer1, n.layer2, n.layer3

    @torch.no_grad()
    def forward(self, x):
        f1 = self.l1(self.stem(x))
        f2 = self.l2(f1)
        return [f1, f2, self.l3(f2)]


def cgr(cin, cout, s=1, k=3):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.GroupNorm(32, cout), nn.ReLU(True))


def up(cin, cout):
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 2, 2, bias=False), nn.GroupNorm(32, cout), nn.ReLU(True),
                         cgr(cout, cout), cgr(cout, cout))


class MultiClassStudent(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.p1 = nn.Sequential(cgr(256, 512, 2), cgr(512, 1024, 2))
        self.p2 = cgr(512, 1024, 2)
        self.fuse = cgr(3072, 2048, 2)
        self.adapters = nn.ModuleList([nn.Conv2d(2048, 2048, 1) for _ in range(n_classes)])
        self.d3, self.d2, self.d1 = up(2048, 1024), up(1024, 512), up(512, 256)

    def forward(self, feats, cls):
        f1, f2, f3 = feats
        z = self.fuse(torch.cat([self.p1(f1), self.p2(f2), f3], 1))
        z = torch.stack([self.adapters[int(c)](z[i:i + 1])[0] for i, c in enumerate(cls.tolist())])
        d3 = self.d3(z)
        d2 = self.d2(d3)
        return [self.d1(d2), d2, d3]


def cos_distill(t_feats, s_feats):
    return sum((1 - F.cosine_similarity(t.flatten(1), s.flatten(1))).mean() for t, s in zip(t_feats, s_feats))


@torch.no_grad()
def evaluate(teacher, student, loader, device, n_test):
    student.eval()
    rows, maps = [], []
    for x, m, y, ci, idx in loader:
        x = x.to(device, non_blocking=True)
        t = teacher(x)
        s = student(t, ci)
        amap = sum(F.interpolate(1 - F.cosine_similarity(a, b).unsqueeze(1), size=(SIZE, SIZE), mode="bilinear",
                                 align_corners=False) for a, b in zip(t, s))
        amap = F.avg_pool2d(amap, 9, 1, 4)[:, 0, ::EVAL_STRIDE, ::EVAL_STRIDE]
        gt = m.to(device)[:, 0, ::EVAL_STRIDE, ::EVAL_STRIDE]
        rows.append(torch.stack([idx.to(device).float(), ci.to(device).float(), y.to(device).float(),
                                 amap.flatten(1).max(1).values], 1))
        maps.append(torch.stack([amap, gt], 1))
    student.train()
    rows, maps = torch.cat(rows), torch.cat(maps)
    # every rank holds the same number of samples (DistributedSampler pads), so plain all_gather works
    all_rows = torch.empty((dist.get_world_size() * rows.shape[0],) + rows.shape[1:], device=device)
    all_maps = torch.empty((dist.get_world_size() * maps.shape[0],) + maps.shape[1:], device=device)
    dist.all_gather_into_tensor(all_rows, rows)
    dist.all_gather_into_tensor(all_maps, maps)
    if dist.get_rank() != 0:
        return None
    idx = all_rows[:, 0].long().cpu().numpy()
    _, keep = np.unique(idx, return_index=True)  # drop the padded duplicates
    assert len(keep) == n_test
    rows, maps = all_rows[keep].cpu().numpy(), all_maps[keep].cpu().numpy()
    results = {}
    for ci, cat in enumerate(CATEGORIES):
        sel = rows[:, 1] == ci
        results[cat] = (roc_auc_score(rows[sel, 2], rows[sel, 3]),
                        roc_auc_score(maps[sel, 1].ravel().astype(np.uint8), maps[sel, 0].ravel()))
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/mvtec_ad")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--out", default="runs/multiclass_rd")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    teacher = Teacher().to(device).eval()
    student = MultiClassStudent(len(CATEGORIES)).to(device)
    # a batch holds only some of the 15 categories, so the other adapters get no gradient that step
    student = DDP(student, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr, betas=(0.5, 0.999))
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        student.module.load_state_dict(ck["student"])
        optimizer.load_state_dict(ck["optimizer"])
        start = ck["epoch"] + 1

    train_ds, test_ds = AllCategories(args.data, "train"), AllCategories(args.data, "test")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=32, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=8, pin_memory=True)
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0, acc = time.time(), torch.zeros(2, device=device)
        for x, _, _, ci, _ in loader:
            x = x.to(device, non_blocking=True)
            t_feats = teacher(x)
            loss = cos_distill(t_feats, student(t_feats, ci))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            res = evaluate(teacher, student.module, test_loader, device, len(test_ds))
            if rank == 0:
                for cat, (ia, pa) in res.items():
                    print(f"  {cat:11s} image {ia:.4f} pixel {pa:.4f}")
                print(f"  mean        image {np.mean([r[0] for r in res.values()]):.4f} "
                      f"pixel {np.mean([r[1] for r in res.values()]):.4f}", flush=True)
                torch.save({"student": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, out / "last.pth")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
