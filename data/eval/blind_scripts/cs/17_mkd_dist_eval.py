"""Multiresolution Knowledge Distillation (MKD) for anomaly detection - DDP training and sharded evaluation.

A compact VGG-style student mimics the activations of an ImageNet VGG16 teacher at several
depths on normal images only (value + direction losses). The test set is split across the
GPUs for scoring; the per-image scores are gathered to compute AUROC over the full test set.

    torchrun --nproc_per_node=4 17_mkd_dist_eval.py --category toothbrush
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
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms as T

TAPS = (3, 8, 15, 22, 29)  # ReLU outputs of VGG16 blocks 1-5 (indices into .features)


class Items(Dataset):
    def __init__(self, root, category, split, size=128):
        self.base = Path(root) / category
        self.files = sorted((self.base / split).glob("*/*.png"))
        self.tf = T.Compose([T.Resize((size, size)), T.ToTensor(),
                             T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.size = size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        f = self.files[i]
        x = self.tf(Image.open(f).convert("RGB"))
        if f.parent.name == "good":
            m = torch.zeros(self.size, self.size)
        else:
            gt = Image.open(self.base / "ground_truth" / f.parent.name / f"{f.stem}_mask.png")
            m = torch.from_numpy(np.asarray(gt.resize((self.size, self.size), Image.NEAREST)) > 127).float()
        return x, m, int(f.parent.name != "good"), i


class Tapped(nn.Module):
    def __init__(self, features, taps):
        super().__init__()
        self.features, self.taps = features, set(taps)

    def forward(self, x):
        outs = []
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i in self.taps:
                outs.append(x)
        return outs


def teacher_net():
    vgg = models.vgg16(weights=models.VGG16_Weights.IMAGENET1K_V1)
    return Tapped(vgg.features[:30], TAPS)


def student_net():
    cfg = [16, 16, "M", 16, 128, "M", 16, 16, 256, "M", 16, 16, 512, "M", 16, 16, 512, "M"]
    layers, cin = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
            cin = v
    feats = nn.Sequential(*layers)
    taps = [i - 1 for i, l in enumerate(feats) if isinstance(l, nn.MaxPool2d)]
    # student taps are the ReLUs right before each pooling; widths match the teacher's
    # 64/128/256/512/512 through 1x1 adapters
    return nn.ModuleDict({"body": Tapped(feats, taps),
                          "adapt": nn.ModuleList([nn.Conv2d(c, t, 1) for c, t in
                                                  zip([16, 128, 256, 512, 512], [64, 128, 256, 512, 512])])})


class Student(nn.Module):
    def __init__(self):
        super().__init__()
        s = student_net()
        self.body, self.adapt = s["body"], s["adapt"]

    def forward(self, x):
        return [a(f) for a, f in zip(self.adapt, self.body(x))]


def mkd_loss(t_feats, s_feats, lamda=0.01):
    value = sum(F.mse_loss(s, t) for s, t in zip(s_feats, t_feats))
    direction = sum((1 - F.cosine_similarity(s.flatten(1), t.flatten(1), dim=1)).mean()
                    for s, t in zip(s_feats, t_feats))
    return value * lamda + direction


@torch.no_grad()
def score_batch(teacher, student, x):
    t_feats, s_feats = teacher(x), student(x)
    amap = 0
    for t, s in zip(t_feats[2:], s_feats[2:]):
        d = 1 - F.cosine_similarity(t, s, dim=1).unsqueeze(1)
        amap = amap + F.interpolate(d, size=x.shape[-2:], mode="bilinear", align_corners=False)
    return amap.squeeze(1)


@torch.no_grad()
def distributed_eval(teacher, student, loader, device, world):
    student.eval()
    idxs, img_scores, maps, masks, labels = [], [], [], [], []
    for x, m, y, idx in loader:
        amap = score_batch(teacher, student, x.to(device, non_blocking=True)).cpu().numpy()
        amap = np.stack([gaussian_filter(a, sigma=4) for a in amap])
        idxs.append(idx)
        img_scores.append(torch.from_numpy(amap.reshape(len(amap), -1).max(1)))
        maps.append(torch.from_numpy(amap))
        masks.append(m)
        labels.append(y)
    student.train()
    local = [torch.cat(idxs), torch.cat(img_scores), torch.cat(maps), torch.cat(masks), torch.cat(labels)]
    gathered = []
    for t in local:
        buf = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        gathered.append(torch.cat(buf))
    idx, s_img, s_map, mask, label = gathered
    # DistributedSampler pads the last shard with repeated samples; keep one copy per image
    _, first = np.unique(idx.numpy(), return_index=True)
    s_img, s_map, mask, label = s_img[first], s_map[first], mask[first], label[first]
    return (roc_auc_score(label.numpy(), s_img.numpy()),
            roc_auc_score(mask.numpy().astype(np.uint8).ravel(), s_map.numpy().ravel()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/mvtec")
    ap.add_argument("--category", default="toothbrush")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--out", default="checkpoints/mkd")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    teacher = teacher_net().to(device).eval().requires_grad_(False)
    student = DDP(Student().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr)

    train_ds = Items(args.data, args.category, "train", args.size)
    test_ds = Items(args.data, args.category, "test", args.size)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=32, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=6, pin_memory=True)

    out_dir = Path(args.out) / args.category
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0, running = time.time(), torch.zeros(2, device=device)
        for x, _, _, _ in train_loader:
            x = x.to(device, non_blocking=True)
            with torch.no_grad():
                t_feats = teacher(x)
            loss = mkd_loss(t_feats, student(x))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        if rank == 0 and epoch % 10 == 0:
            print(f"epoch {epoch} loss {running[0].item() / running[1].item():.4f} ({time.time() - t0:.1f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            img_auc, pix_auc = distributed_eval(teacher, student.module, test_loader, device, world)
            if rank == 0:
                print(f"epoch {epoch + 1}: image AUROC {img_auc:.4f} pixel AUROC {pix_auc:.4f}", flush=True)
                torch.save({"student": student.module.state_dict(), "epoch": epoch, "image_auroc": img_auc},
                           out_dir / "last.pth")
                if img_auc > best:
                    best = img_auc
                    torch.save({"student": student.module.state_dict(), "epoch": epoch, "image_auroc": img_auc},
                               out_dir / "best.pth")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
