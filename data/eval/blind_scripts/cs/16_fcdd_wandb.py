"""FCDD - Fully Convolutional Data Description for explainable defect localisation.

Normal samples are pulled towards the centre of the output space, synthetic "confetti"
anomalies (outlier exposure) are pushed away with the hypersphere classifier (HSC) loss.
Logged to Weights & Biases.

    torchrun --nproc_per_node=4 16_fcdd_wandb.py --category hazelnut --wandb-project fcdd-mvtec
"""
import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms as T


def confetti(img, n_blobs=(5, 20), size=(4, 24)):
    """Paste random coloured rectangles (confetti noise) onto a normalised image tensor."""
    c, h, w = img.shape
    out, mask = img.clone(), torch.zeros(1, h, w)
    for _ in range(random.randint(*n_blobs)):
        bh, bw = random.randint(*size), random.randint(*size)
        y, x = random.randint(0, h - bh), random.randint(0, w - bw)
        out[:, y:y + bh, x:x + bw] = torch.randn(c, 1, 1) * 1.5
        mask[:, y:y + bh, x:x + bw] = 1
    return out, mask


class FCDDTrainSet(Dataset):
    def __init__(self, root, category, size=224, oe_prob=0.5):
        self.files = sorted((Path(root) / category / "train" / "good").glob("*.png"))
        self.tf = T.Compose([T.Resize((size, size)), T.RandomHorizontalFlip(), T.ColorJitter(0.04, 0.04, 0.04, 0.04),
                             T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.oe_prob = oe_prob

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = self.tf(Image.open(self.files[i]).convert("RGB"))
        if random.random() < self.oe_prob:
            x, _ = confetti(x)
            return x, 1
        return x, 0


class FCDDTestSet(Dataset):
    def __init__(self, root, category, size=224):
        self.base = Path(root) / category
        self.files = sorted((self.base / "test").glob("*/*.png"))
        self.tf = T.Compose([T.Resize((size, size)), T.ToTensor(),
                             T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.mtf = T.Compose([T.Resize((size, size), T.InterpolationMode.NEAREST), T.ToTensor()])
        self.size = size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        f = self.files[i]
        x = self.tf(Image.open(f).convert("RGB"))
        if f.parent.name == "good":
            return x, torch.zeros(1, self.size, self.size), 0
        return x, (self.mtf(Image.open(self.base / "ground_truth" / f.parent.name / f"{f.stem}_mask.png")) > .5).float(), 1


class FCDDNet(nn.Module):
    """VGG11-BN features up to a 28x28 receptive field grid, 1x1 conv to one channel."""

    def __init__(self):
        super().__init__()
        vgg = models.vgg11_bn(weights=models.VGG11_BN_Weights.IMAGENET1K_V1)
        self.features = nn.Sequential(*list(vgg.features.children())[:15])  # 256 ch, stride 8
        for p in list(self.features.parameters())[:8]:
            p.requires_grad = False  # keep the first two blocks frozen
        self.head = nn.Sequential(nn.Conv2d(256, 128, 3, padding=1), nn.BatchNorm2d(128), nn.LeakyReLU(0.1),
                                  nn.Conv2d(128, 1, 1))

    def forward(self, x):
        return self.head(self.features(x))


def hsc_loss(out, label):
    """Pseudo-Huber distance per pixel averaged per image; HSC objective for OE samples."""
    a = (torch.sqrt(out ** 2 + 1) - 1).flatten(1).mean(1)
    return torch.where(label == 0, a, -torch.log(-torch.expm1(-a) + 1e-9)).mean()


def upsample_receptive(amap, size, sigma=8):
    """FCDD's Gaussian upsampling of the low-resolution heatmap."""
    amap = F.interpolate(amap, size=size, mode="bilinear", align_corners=False)
    k = 2 * int(3 * sigma) + 1
    g = torch.exp(-((torch.arange(k, device=amap.device) - k // 2) ** 2) / (2 * sigma ** 2))
    g = (g / g.sum()).view(1, 1, 1, k)
    amap = F.conv2d(F.pad(amap, (k // 2, k // 2, 0, 0), mode="reflect"), g)
    return F.conv2d(F.pad(amap, (0, 0, k // 2, k // 2), mode="reflect"), g.transpose(2, 3))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    ys, s_img, ms, s_pix = [], [], [], []
    for x, m, y in loader:
        out = net(x.to(device))
        a = torch.sqrt(out ** 2 + 1) - 1
        s_img.append(a.flatten(1).mean(1).cpu())
        ys.append(y)
        amap = upsample_receptive(a, x.shape[-2:])
        s_pix.append(amap[:, :, ::2, ::2].flatten().cpu())
        ms.append(m[:, :, ::2, ::2].flatten())
    net.train()
    return (roc_auc_score(torch.cat(ys).numpy(), torch.cat(s_img).numpy()),
            roc_auc_score(torch.cat(ms).numpy().astype(np.uint8), torch.cat(s_pix).numpy()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/datasets/mvtec_ad")
    ap.add_argument("--category", default="hazelnut")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--oe-prob", type=float, default=0.5)
    ap.add_argument("--wandb-project", default="fcdd-mvtec")
    ap.add_argument("--out", default="runs/fcdd")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(7 + rank)
    torch.manual_seed(7 + rank)

    run = wandb.init(project=args.wandb_project, name=f"fcdd-{args.category}", config=vars(args),
                     tags=[args.category, f"gpus={world}"])

    train_ds = FCDDTrainSet(args.data_root, args.category, oe_prob=args.oe_prob)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True)
    test_loader = DataLoader(FCDDTestSet(args.data_root, args.category), batch_size=32, num_workers=8)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(FCDDNet()).to(device)
    net = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=args.lr, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda ep: 0.985 ** ep)

    out_dir = Path(args.out) / args.category
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = hsc_loss(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            if global_step % 10 == 0:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=global_step)
        scheduler.step()

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                img_auc, pix_auc = evaluate(net.module, test_loader, device)
                wandb.log({"test/image_auroc": img_auc, "test/pixel_auroc": pix_auc,
                           "epoch_time": time.time() - t0}, step=global_step)
                print(f"[{args.category}] epoch {epoch + 1}: image {img_auc:.4f} pixel {pix_auc:.4f}", flush=True)
                torch.save({"net": net.module.state_dict(), "epoch": epoch}, out_dir / "fcdd.pth")
            dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
