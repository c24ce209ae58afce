"""DeSTSeg-style training: denoising student-teacher + segmentation head, synthetic defects.

The teacher (frozen ImageNet ResNet-18) sees the clean image, the student encoder-decoder sees
the image with synthetic defects and has to reproduce the teacher's clean features. A small
segmentation network is trained on the teacher/student feature discrepancy to localise the
synthetic defects.

    torchrun --nproc_per_node=4 13_destseg_train.py --category metal_nut --dtd /data/dtd/images
"""
import argparse
import glob
import os
import random

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import ResNet18_Weights, resnet18

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def random_blob_mask(size, rng, n_max=3):
    mask = np.zeros((size, size), np.uint8)
    for _ in range(rng.integers(1, n_max + 1)):
        c = tuple(int(v) for v in rng.integers(size // 8, size - size // 8, 2))
        axes = tuple(int(v) for v in rng.integers(size // 32, size // 6, 2))
        cv2.ellipse(mask, c, axes, float(rng.uniform(0, 180)), 0, 360, 1, -1)
    mask = cv2.GaussianBlur(mask.astype(np.float32), (7, 7), 0)
    return (mask > 0.5).astype(np.float32)


class SyntheticDefects(Dataset):
    def __init__(self, root, category, dtd_root, size=256, p_anomaly=0.5):
        self.files = sorted(glob.glob(os.path.join(root, category, "train", "good", "*.png")))
        self.textures = sorted(glob.glob(os.path.join(dtd_root, "*", "*.jpg")))
        self.size, self.p = size, p_anomaly
        self.rng = np.random.default_rng()

    def __len__(self):
        return len(self.files)

    def _load(self, path):
        img = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB)
        return cv2.resize(img, (self.size, self.size)).astype(np.float32) / 255.0

    def __getitem__(self, i):
        img = self._load(self.files[i])
        mask = np.zeros((self.size, self.size), np.float32)
        aug = img.copy()
        if self.rng.random() < self.p:
            tex = self._load(self.textures[self.rng.integers(len(self.textures))])
            mask = random_blob_mask(self.size, self.rng)
            beta = self.rng.uniform(0.1, 0.8)
            m = mask[..., None]
            aug = img * (1 - m) + m * ((1 - beta) * tex + beta * img)
        norm = lambda a: torch.from_numpy(((a - MEAN) / STD).transpose(2, 0, 1).copy())
        return norm(img), norm(aug.astype(np.float32)), torch.from_numpy(mask)[None]


class TestSet(SyntheticDefects):
    def __init__(self, root, category, size=256):
        self.items = []
        for p in sorted(glob.glob(os.path.join(root, category, "test", "*", "*.png"))):
            d = os.path.basename(os.path.dirname(p))
            gt = None if d == "good" else os.path.join(root, category, "ground_truth", d,
                                                      os.path.basename(p).replace(".png", "_mask.png"))
            self.items.append((p, gt))
        self.size = size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, gt = self.items[i]
        img = self._load(p)
        m = np.zeros((self.size, self.size), np.float32) if gt is None else \
            (cv2.resize(cv2.imread(gt, 0), (self.size, self.size), interpolation=cv2.INTER_NEAREST) > 127).astype(np.float32)
        return torch.from_numpy(((img - MEAN) / STD).transpose(2, 0, 1).copy()), torch.from_numpy(m)[None], int(gt is not None)


def r18_stages(pretrained):
    n = resnet18(weights=ResNet18_Weights.IMAGENET1K_V1 if pretrained else None)
    return nn.ModuleList([nn.Sequential(n.conv1, n.bn1, n.relu, n.maxpool, n.layer1), n.layer2, n.layer3])


class Student(nn.Module):
    """Encoder (ResNet-18 stages, random init) + feature decoder back to layer1..layer3 shapes."""

    def __init__(self):
        super().__init__()
        self.enc = r18_stages(pretrained=False)
        self.bottleneck = nn.Sequential(nn.Conv2d(256, 512, 3, 2, 1), nn.BatchNorm2d(512), nn.ReLU(True))
        self.up3 = nn.Sequential(nn.ConvTranspose2d(512, 256, 2, 2), nn.BatchNorm2d(256), nn.ReLU(True))
        self.up2 = nn.Sequential(nn.ConvTranspose2d(256, 128, 2, 2), nn.BatchNorm2d(128), nn.ReLU(True))
        self.up1 = nn.Sequential(nn.ConvTranspose2d(128, 64, 2, 2), nn.BatchNorm2d(64), nn.ReLU(True))

    def forward(self, x):
        for stage in self.enc:
            x = stage(x)
        d3 = self.up3(self.bottleneck(x))
        d2 = self.up2(d3)
        d1 = self.up1(d2)
        return [d1, d2, d3]


class SegHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(64 + 128 + 256, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(True),
                                 nn.Conv2d(256, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(True),
                                 nn.Conv2d(128, 1, 1))

    def forward(self, t_feats, s_feats):
        size = t_feats[0].shape[-2:]
        x = torch.cat([F.interpolate(F.normalize(t, dim=1) * F.normalize(s, dim=1), size=size, mode="bilinear",
                                     align_corners=False) for t, s in zip(t_feats, s_feats)], 1)
        return self.net(x)


class DeSTSeg(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = Student()
        self.seg = SegHead()

    def forward(self, t_feats, x_aug):
        s_feats = self.student(x_aug)
        seg = self.seg([t.detach() for t in t_feats], [s.detach() for s in s_feats])
        return s_feats, seg


def cos_loss(t_feats, s_feats):
    return sum((1 - F.cosine_similarity(t, s, dim=1)).mean() for t, s in zip(t_feats, s_feats))


def focal_bce(logits, target, gamma=4.0):
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    pt = p * target + (1 - p) * (1 - target)
    return ((1 - pt) ** gamma * ce).mean()


@torch.no_grad()
def evaluate(teacher, model, loader, device):
    model.eval()
    ys, ss, ms, ps = [], [], [], []
    for x, m, y in loader:
        x = x.to(device)
        t = [f for f in run_teacher(teacher, x)]
        _, seg = model(t, x)
        prob = F.interpolate(torch.sigmoid(seg), size=x.shape[-2:], mode="bilinear", align_corners=False)
        ss.append(prob.flatten(1).topk(100, dim=1).values.mean(1).cpu())
        ys.append(y)
        ps.append(prob[:, :, ::2, ::2].flatten().cpu())
        ms.append(m[:, :, ::2, ::2].flatten())
    model.train()
    return (roc_auc_score(torch.cat(ys).numpy(), torch.cat(ss).numpy()),
            roc_auc_score(torch.cat(ms).numpy().astype(np.uint8), torch.cat(ps).numpy()))


@torch.no_grad()
def run_teacher(teacher, x):
    feats = []
    for stage in teacher:
        x = stage(x)
        feats.append(x)
    return feats


def seed_worker(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed % 2 ** 32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/mvtec")
    ap.add_argument("--dtd", default="/data/dtd/images")
    ap.add_argument("--category", default="metal_nut")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr-student", type=float, default=0.4, help="for a global batch of 32")
    ap.add_argument("--lr-seg", type=float, default=0.01, help="for a global batch of 32")
    ap.add_argument("--out", default="runs/destseg")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)  # distinct synthetic-defect streams per rank

    teacher = r18_stages(pretrained=True).to(device).eval().requires_grad_(False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(DeSTSeg()).to(device)
    model = DDP(model, device_ids=[local_rank])
    scale = args.batch_size * dist.get_world_size() / 32
    optimizer = torch.optim.SGD([
        {"params": model.module.student.parameters(), "lr": args.lr_student * scale},
        {"params": model.module.seg.parameters(), "lr": args.lr_seg * scale},
    ], momentum=0.9, weight_decay=1e-4)

    ds = SyntheticDefects(args.data, args.category, args.dtd)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, drop_last=True,
                        pin_memory=True, worker_init_fn=seed_worker)
    test_loader = DataLoader(TestSet(args.data, args.category), batch_size=16, num_workers=4)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, x_aug, mask in loader:
            x, x_aug, mask = x.to(device), x_aug.to(device), mask.to(device)
            if mask.sum() == 0:
                continue
            t_feats = run_teacher(teacher, x)
            s_feats, seg = model(t_feats, x_aug)
            mask_s = F.interpolate(mask, size=seg.shape[-2:], mode="nearest")
            loss = cos_loss(t_feats, s_feats) + focal_bce(seg, mask_s) + F.l1_loss(torch.sigmoid(seg), mask_s)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if rank == 0 and step % 1000 == 0:
                img_auc, pix_auc = evaluate(teacher, model.module, test_loader, device)
                print(f"step {step}: image AUROC {img_auc:.4f} pixel AUROC {pix_auc:.4f}", flush=True)
                torch.save({"model": model.module.state_dict(), "step": step},
                           os.path.join(args.out, f"{args.category}_destseg.pth"))
            if step >= args.steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
