#!/usr/bin/env python
"""DRAEM training (reconstructive + discriminative sub-networks) on nominal
images of one product line, with Perlin-noise synthetic defects textured from
DTD. Multi-GPU via DDP.

    torchrun --standalone --nproc_per_node=8 draem_train.py \
        --data /datasets/visa --category pcb3 --dtd /datasets/dtd/images
"""
import argparse
import glob
import math
import os
import random
import time

import cv2
import imgaug.augmenters as iaa
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from kornia.losses import FocalLoss, ssim_loss
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def rand_perlin_2d(shape, res, rng):
    delta = (res[0] / shape[0], res[1] / shape[1])
    d = (shape[0] // res[0], shape[1] // res[1])
    grid = np.mgrid[0:res[0]:delta[0], 0:res[1]:delta[1]].transpose(1, 2, 0) % 1
    angles = 2 * math.pi * rng.random((res[0] + 1, res[1] + 1))
    grads = np.stack((np.cos(angles), np.sin(angles)), axis=-1)
    tile = lambda s1, s2: np.repeat(np.repeat(grads[s1[0]:s1[1], s2[0]:s2[1]], d[0], 0), d[1], 1)
    dot = lambda g, sx, sy: ((np.stack((grid[:shape[0], :shape[1], 0] + sx, grid[:shape[0], :shape[1], 1] + sy), -1)) * g[:shape[0], :shape[1]]).sum(-1)
    n00 = dot(tile([0, -1], [0, -1]), 0, 0)
    n10 = dot(tile([1, None], [0, -1]), -1, 0)
    n01 = dot(tile([0, -1], [1, None]), 0, -1)
    n11 = dot(tile([1, None], [1, None]), -1, -1)
    t = 6 * grid ** 5 - 15 * grid ** 4 + 10 * grid ** 3
    lerp = lambda a, b, w: (b - a) * w + a
    return math.sqrt(2) * lerp(lerp(n00, n10, t[..., 0]), lerp(n01, n11, t[..., 0]), t[..., 1])


class DraemTrainSet(Dataset):
    def __init__(self, image_dir, dtd_dir, size):
        self.images = sorted(glob.glob(os.path.join(image_dir, "*.png")) + glob.glob(os.path.join(image_dir, "*.JPG")))
        self.textures = sorted(glob.glob(os.path.join(dtd_dir, "*", "*.jpg")))
        self.size = size
        self.augmenters = [iaa.GammaContrast((0.5, 2.0), per_channel=True),
                           iaa.MultiplyAndAddToBrightness(mul=(0.8, 1.2), add=(-30, 30)),
                           iaa.pillike.EnhanceSharpness(), iaa.AddToHueAndSaturation((-50, 50), per_channel=True),
                           iaa.Solarize(0.5, threshold=(32, 128)), iaa.Posterize(), iaa.Invert(),
                           iaa.pillike.Autocontrast(), iaa.pillike.Equalize(), iaa.Affine(rotate=(-45, 45))]

    def __len__(self):
        return len(self.images)

    def _load(self, path):
        img = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB)
        return cv2.resize(img, (self.size, self.size))

    def __getitem__(self, idx):
        rng = np.random.default_rng()
        image = self._load(self.images[idx])
        if rng.random() < 0.5:
            image = np.rot90(image, k=rng.integers(4)).copy()
        texture = self._load(self.textures[rng.integers(len(self.textures))])
        aug = iaa.Sequential([self.augmenters[i] for i in rng.choice(len(self.augmenters), 3, replace=False)])
        texture = aug(image=texture)

        scale = 2 ** rng.integers(0, 6, size=2)
        noise = rand_perlin_2d((self.size, self.size), (int(scale[0]), int(scale[1])), rng)
        noise = iaa.Affine(rotate=(-90, 90))(image=noise)
        mask = (noise > 0.5).astype(np.float32)[..., None]

        image = image.astype(np.float32) / 255.0
        texture = texture.astype(np.float32) / 255.0
        beta = rng.random() * 0.8
        augmented = image * (1 - mask) + (1 - beta) * texture * mask + beta * image * mask
        if rng.random() > 0.5:  # half the samples stay nominal
            augmented, mask = image.copy(), np.zeros_like(mask)

        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return to_t(image), to_t(augmented.astype(np.float32)), to_t(mask)


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, cin, cout, base=64, depth=4, skip=True):
        super().__init__()
        self.skip = skip
        chans = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([conv_block(cin if i == 0 else chans[i - 1], chans[i]) for i in range(depth + 1)])
        self.up = nn.ModuleList([nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2) for i in reversed(range(depth))])
        self.dec = nn.ModuleList([conv_block(chans[i] * (2 if skip else 1), chans[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(base, cout, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.down):
            x = blk(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, dec, s in zip(self.up, self.dec, reversed(skips[:-1])):
            x = up(x)
            x = dec(torch.cat([x, s], 1) if self.skip else x)
        return self.head(x)


class DRAEM(nn.Module):
    def __init__(self):
        super().__init__()
        self.reconstructive = UNet(3, 3, base=128, skip=False)
        self.discriminative = UNet(6, 2, base=64, skip=True)

    def forward(self, x):
        rec = self.reconstructive(x)
        seg = self.discriminative(torch.cat([rec, x], 1))
        return rec, seg


@torch.no_grad()
def evaluate(model, test_root, size, device):
    """Image AUROC from the max of the smoothed defect probability (rank 0 only)."""
    model.eval()
    scores, labels = [], []
    for defect in sorted(os.listdir(test_root)):
        for path in sorted(glob.glob(os.path.join(test_root, defect, "*.png")) + glob.glob(os.path.join(test_root, defect, "*.JPG"))):
            img = cv2.resize(cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB), (size, size))
            x = torch.from_numpy(img.astype(np.float32).transpose(2, 0, 1) / 255.0)[None].to(device)
            _, seg = model(x)
            prob = torch.softmax(seg, 1)[:, 1:]
            scores.append(F.avg_pool2d(prob, 21, stride=1, padding=10).max().item())
            labels.append(0 if defect == "good" else 1)
    model.train()
    return roc_auc_score(labels, scores)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--category", required=True)
    ap.add_argument("--dtd", required=True)
    ap.add_argument("--out", default="./checkpoints/draem")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=700)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda")
    torch.manual_seed(1234)

    ds = DraemTrainSet(os.path.join(args.data, args.category, "train", "good"), args.dtd, args.size)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DRAEM()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    # the reference recipe trains with batch 8 on one GPU; keep the per-sample step size
    lr = args.lr * args.batch_size * world / 8
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(args.epochs * 0.8), int(args.epochs * 0.9)], gamma=0.2)
    focal = FocalLoss(alpha=0.25, gamma=2.0, reduction="mean")

    writer = SummaryWriter(os.path.join(args.out, args.category, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(os.path.join(args.out, args.category), exist_ok=True)
        print(f"{len(ds)} nominal images, {world} GPUs, lr {lr:.2e}")

    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        totals = torch.zeros(3, device=device)
        for image, augmented, mask in loader:
            image = image.to(device, non_blocking=True)
            augmented = augmented.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)

            rec, seg = model(augmented)
            l2 = F.mse_loss(rec, image)
            ssim = ssim_loss(rec, image, window_size=11)
            seg_loss = focal(seg, mask[:, 0].long())
            loss = l2 + ssim + seg_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            totals += torch.stack([l2.detach(), ssim.detach(), seg_loss.detach()])
            global_step += 1
        scheduler.step()

        totals /= len(loader)
        dist.all_reduce(totals, op=dist.ReduceOp.AVG)
        if rank == 0:
            l2, ssim, seg_l = totals.tolist()
            writer.add_scalar("loss/l2", l2, epoch)
            writer.add_scalar("loss/ssim", ssim, epoch)
            writer.add_scalar("loss/focal", seg_l, epoch)
            print(f"epoch {epoch:4d}  l2 {l2:.4f}  ssim {ssim:.4f}  focal {seg_l:.4f}  {time.time() - t0:.1f}s")
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(args.out, args.category, f"draem_{epoch + 1}.pt"))
            if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
                auroc = evaluate(model.module, os.path.join(args.data, args.category, "test"), args.size, device)
                writer.add_scalar("eval/image_auroc", auroc, epoch)
                print(f"epoch {epoch:4d}  image AUROC {auroc:.4f}")
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
