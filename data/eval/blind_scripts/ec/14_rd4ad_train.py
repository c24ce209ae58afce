"""Reverse Distillation (RD4AD) with distributed evaluation.

Teacher: frozen WRN50-2 encoder (layer1..3). OCBE bottleneck + student
decoder mirror it. Anomaly map = sum over levels of 1 - cos(teacher, student).
Evaluation runs on all GPUs every few epochs; the best checkpoint is kept by
image AUROC.

    torchrun --nproc_per_node=4 14_rd4ad_train.py --data /data/mvtec_ad --category transistor \
        --out /shared/rd4ad
"""
import argparse
import os
import time

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
from torchvision import transforms
from torchvision.models import wide_resnet50_2, Wide_ResNet50_2_Weights
from torchvision.models.resnet import Bottleneck

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class MVTecAD(Dataset):
    def __init__(self, root, category, train, size=256):
        split_dir = os.path.join(root, category, "train" if train else "test")
        self.samples = []
        for d in sorted(os.listdir(split_dir)):
            for f in sorted(os.listdir(os.path.join(split_dir, d))):
                gt = None if d == "good" else os.path.join(root, category, "ground_truth", d, f[:-4] + "_mask.png")
                self.samples.append((os.path.join(split_dir, d, f), gt, int(d != "good")))
        self.img_tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                                          transforms.Normalize(MEAN, STD)])
        self.gt_tf = transforms.Compose([transforms.Resize((size, size), transforms.InterpolationMode.NEAREST),
                                         transforms.ToTensor()])
        self.size = size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, gt, label = self.samples[i]
        img = self.img_tf(Image.open(path).convert("RGB"))
        mask = torch.zeros(1, self.size, self.size) if gt is None else (self.gt_tf(Image.open(gt)) > 0.5).float()
        return img, mask, label


class TeacherEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        net = wide_resnet50_2(weights=Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3 = net.layer1, net.layer2, net.layer3

    def forward(self, x):
        f1 = self.layer1(self.stem(x))
        f2 = self.layer2(f1)
        f3 = self.layer3(f2)
        return [f1, f2, f3]


class OCBE(nn.Module):
    """One-class bottleneck: fuse the three teacher levels into one embedding."""

    def __init__(self):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(256, 512, 3, 2, 1, bias=False), nn.BatchNorm2d(512), nn.ReLU(True),
                                   nn.Conv2d(512, 1024, 3, 2, 1, bias=False), nn.BatchNorm2d(1024), nn.ReLU(True))
        self.down2 = nn.Sequential(nn.Conv2d(512, 1024, 3, 2, 1, bias=False), nn.BatchNorm2d(1024), nn.ReLU(True))
        down = nn.Sequential(nn.Conv2d(3072, 2048, 1, 2, bias=False), nn.BatchNorm2d(2048))
        self.fuse = nn.Sequential(Bottleneck(3072, 512, stride=2, downsample=down))

    def forward(self, feats):
        f1, f2, f3 = feats
        return self.fuse(torch.cat([self.down1(f1), self.down2(f2), f3], dim=1))


def up_block(cin, cout):
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 2, 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True))


class StudentDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up3, self.up2, self.up1 = up_block(2048, 1024), up_block(1024, 512), up_block(512, 256)

    def forward(self, z):
        d3 = self.up3(z)
        d2 = self.up2(d3)
        d1 = self.up1(d2)
        return [d1, d2, d3]


class RD4AD(nn.Module):
    def __init__(self):
        super().__init__()
        self.teacher = TeacherEncoder()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.bottleneck = OCBE()
        self.decoder = StudentDecoder()

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x)
        s = self.decoder(self.bottleneck(t))
        return t, s


def cos_loss(t_feats, s_feats):
    return sum(torch.mean(1 - F.cosine_similarity(t.flatten(1), s.flatten(1))) for t, s in zip(t_feats, s_feats))


@torch.no_grad()
def anomaly_map(t_feats, s_feats, size):
    amap = 0
    for t, s in zip(t_feats, s_feats):
        a = 1 - F.cosine_similarity(t, s, dim=1).unsqueeze(1)
        amap = amap + F.interpolate(a, size=size, mode="bilinear", align_corners=True)
    return amap.squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device, size):
    model.eval()
    img_scores, img_labels, px_scores, px_labels = [], [], [], []
    for img, mask, label in loader:
        t, s = model(img.to(device, non_blocking=True))
        amap = anomaly_map(t, s, size).cpu().numpy()
        amap = np.stack([gaussian_filter(a, sigma=4) for a in amap])
        img_scores.extend(amap.reshape(len(amap), -1).max(1).tolist())
        img_labels.extend(label.tolist())
        px_scores.append(amap[:, ::4, ::4].ravel())
        px_labels.append(mask[:, 0, ::4, ::4].numpy().ravel())
    model.train()
    img_auroc = roc_auc_score(img_labels, img_scores)
    px_auroc = roc_auc_score(np.concatenate(px_labels), np.concatenate(px_scores))
    return img_auroc, px_auroc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--category", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16, help="global")
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(111)

    train_ds = MVTecAD(args.data, args.category, train=True, size=args.size)
    test_ds = MVTecAD(args.data, args.category, train=False, size=args.size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=8, sampler=test_sampler, num_workers=args.workers, pin_memory=True)

    model = RD4AD()
    model.bottleneck = nn.SyncBatchNorm.convert_sync_batchnorm(model.bottleneck)
    model.decoder = nn.SyncBatchNorm.convert_sync_batchnorm(model.decoder)
    model = DDP(model.to(device), device_ids=[local_rank])
    params = list(model.module.bottleneck.parameters()) + list(model.module.decoder.parameters())
    opt = torch.optim.Adam(params, lr=args.lr, betas=(0.5, 0.999))

    out_dir = os.path.join(args.out, args.category)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for img, _, _ in train_dl:
            t, s = model(img.to(device, non_blocking=True))
            loss = cos_loss(t, s)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        if (epoch + 1) % args.eval_every == 0:
            img_auroc, px_auroc = evaluate(model.module, test_dl, device, args.size)
            if rank == 0:
                print(f"epoch {epoch + 1}: loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                      f"image AUROC {img_auroc:.4f} pixel AUROC {px_auroc:.4f} ({time.time() - t0:.0f}s)",
                      flush=True)
                if img_auroc > best:
                    best = img_auroc
                    torch.save({"bottleneck": model.module.bottleneck.state_dict(),
                                "decoder": model.module.decoder.state_dict(),
                                "epoch": epoch, "image_auroc": img_auroc, "pixel_auroc": px_auroc},
                               os.path.join(out_dir, "rd4ad_best.pth"))
        elif rank == 0:
            print(f"epoch {epoch + 1}: loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
