"""Two-stage MPRNet-lite for rain / water-droplet streak removal (Rain13K train, Rain100L val).

    torchrun --nproc_per_node=4 16_mprnet_derain.py --train-dir /data/Rain13K/train --val-dir /data/Rain100L
"""
import argparse
import os
import random
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-dir", required=True)
    ap.add_argument("--val-dir", required=True)
    ap.add_argument("--run-name", default="mprnet-lite-derain")
    ap.add_argument("--patch", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="total batch size")
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--ckpt-dir", default="./checkpoints/mprnet_derain")
    return ap.parse_args()


# ------------------------------------------------------------------------------ network
class CAB(nn.Module):
    def __init__(self, c, reduction=4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.PReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.ca = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c // reduction, 1), nn.ReLU(True),
                                nn.Conv2d(c // reduction, c, 1), nn.Sigmoid())

    def forward(self, x):
        r = self.body(x)
        return x + r * self.ca(r)


class EncoderDecoder(nn.Module):
    def __init__(self, c=48, step=24):
        super().__init__()
        self.e1 = nn.Sequential(CAB(c), CAB(c))
        self.e2 = nn.Sequential(CAB(c + step), CAB(c + step))
        self.e3 = nn.Sequential(CAB(c + 2 * step), CAB(c + 2 * step))
        self.down12 = nn.Sequential(nn.Upsample(scale_factor=0.5, mode="bilinear"), nn.Conv2d(c, c + step, 1, bias=False))
        self.down23 = nn.Sequential(nn.Upsample(scale_factor=0.5, mode="bilinear"),
                                    nn.Conv2d(c + step, c + 2 * step, 1, bias=False))
        self.up32 = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(c + 2 * step, c + step, 1, bias=False))
        self.up21 = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(c + step, c, 1, bias=False))
        self.d2 = nn.Sequential(CAB(c + step), CAB(c + step))
        self.d1 = nn.Sequential(CAB(c), CAB(c))

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(self.down12(e1))
        e3 = self.e3(self.down23(e2))
        d2 = self.d2(self.up32(e3) + e2)
        return self.d1(self.up21(d2) + e1)


class SAM(nn.Module):
    """Supervised attention module: produces the stage-1 image and attention-gated features."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, 3, 3, padding=1)
        self.conv3 = nn.Conv2d(3, c, 3, padding=1)

    def forward(self, feat, img):
        restored = self.conv2(feat) + img
        attn = torch.sigmoid(self.conv3(restored))
        return self.conv1(feat) * attn + feat, restored


class MPRNetLite(nn.Module):
    def __init__(self, c=48):
        super().__init__()
        self.shallow1 = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), CAB(c))
        self.shallow2 = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), CAB(c))
        self.stage1 = EncoderDecoder(c)
        self.sam = SAM(c)
        self.concat = nn.Conv2d(2 * c, c, 3, padding=1)
        self.stage2 = nn.Sequential(*[CAB(c) for _ in range(8)])
        self.tail = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        f1 = self.stage1(self.shallow1(x))
        sam_feat, out1 = self.sam(f1, x)
        f2 = self.concat(torch.cat([self.shallow2(x), sam_feat], 1))
        out2 = self.tail(self.stage2(f2)) + x
        return out2, out1


def charbonnier(a, b, eps=1e-3):
    return torch.mean(torch.sqrt((a - b) ** 2 + eps * eps))


class EdgeLoss(nn.Module):
    def __init__(self):
        super().__init__()
        k = torch.tensor([[0.05, 0.25, 0.4, 0.25, 0.05]])
        self.register_buffer("kernel", (k.t() @ k).unsqueeze(0).repeat(3, 1, 1, 1))

    def conv_gauss(self, img):
        return F.conv2d(F.pad(img, (2, 2, 2, 2), mode="replicate"), self.kernel, groups=3)

    def laplacian(self, x):
        filtered = self.conv_gauss(x)
        down = filtered[:, :, ::2, ::2]
        up = torch.zeros_like(filtered)
        up[:, :, ::2, ::2] = down * 4
        return x - self.conv_gauss(up)

    def forward(self, x, y):
        return charbonnier(self.laplacian(x), self.laplacian(y))


# ------------------------------------------------------------------------------ data
class RainPairs(Dataset):
    def __init__(self, root, patch=None):
        self.inp = sorted(glob(os.path.join(root, "input", "*.*")))
        self.tar = sorted(glob(os.path.join(root, "target", "*.*")))
        assert len(self.inp) == len(self.tar)
        self.patch = patch

    def __len__(self):
        return len(self.inp)

    def __getitem__(self, i):
        x = cv2.imread(self.inp[i])[:, :, ::-1].astype(np.float32) / 255.0
        y = cv2.imread(self.tar[i])[:, :, ::-1].astype(np.float32) / 255.0
        if self.patch:
            h, w = x.shape[:2]
            if h < self.patch or w < self.patch:
                ph, pw = max(0, self.patch - h), max(0, self.patch - w)
                x = np.pad(x, ((0, ph), (0, pw), (0, 0)), mode="reflect")
                y = np.pad(y, ((0, ph), (0, pw), (0, 0)), mode="reflect")
                h, w = x.shape[:2]
            r, c = random.randint(0, h - self.patch), random.randint(0, w - self.patch)
            x, y = x[r:r + self.patch, c:c + self.patch], y[r:r + self.patch, c:c + self.patch]
            if random.random() < 0.5:
                x, y = x[:, ::-1], y[:, ::-1]
        else:
            h, w = x.shape[:2]
            x = np.pad(x, ((0, (4 - h % 4) % 4), (0, (4 - w % 4) % 4), (0, 0)), mode="reflect")
        f = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return f(x), f(y)


def psnr_y(x, y):
    k = x.new_tensor([65.481, 128.553, 24.966]).view(1, 3, 1, 1) / 255.0
    xy, yy = (x * k).sum(1) + 16 / 255, (y * k).sum(1) + 16 / 255
    return 10 * torch.log10(1.0 / torch.mean((xy.double() - yy.double()) ** 2))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    random.seed(1234 + rank)

    wandb.init(project="camera-derain", name=args.run_name, config=vars(args))

    train_set = RainPairs(args.train_dir, args.patch)
    val_set = RainPairs(args.val_dir)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=1)

    net = MPRNetLite().to(device)
    model = DDP(net, device_ids=[local_rank])
    edge_loss = EdgeLoss().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    warmup = 3
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, 0.01, 1.0, total_iters=warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs - warmup, eta_min=1e-6)],
        milestones=[warmup])

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out2, out1 = model(x)
            l_char = charbonnier(out2, y) + charbonnier(out1, y)
            l_edge = edge_loss(out2, y) + edge_loss(out1, y)
            loss = l_char + 0.05 * l_edge
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/char": l_char.item(), "train/edge": l_edge.item(),
                           "lr": optimizer.param_groups[0]["lr"]}, step=step)
        scheduler.step()

        net.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                out = net(x)[0][..., : y.shape[-2], : y.shape[-1]].clamp(0, 1)
                acc[0] += psnr_y(torch.round(out * 255) / 255, y)
                acc[1] += 1
        dist.all_reduce(acc)
        psnr = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: Rain100L PSNR-Y {psnr:.2f} dB", flush=True)
            wandb.log({"val/psnr_y": psnr, "epoch": epoch}, step=step)
            torch.save({"epoch": epoch, "state_dict": net.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.ckpt_dir, "model_latest.pth"))
            if psnr > best:
                best = psnr
                torch.save({"epoch": epoch, "state_dict": net.state_dict()}, os.path.join(args.ckpt_dir, "model_best.pth"))

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
