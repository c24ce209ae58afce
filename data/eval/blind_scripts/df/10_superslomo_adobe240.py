"""Super SloMo (x8) on Adobe240 / GoPro frame folders.

Each training sample is a 9-frame temporal crop; frames 0 and 8 are the inputs and the 7 frames in between
are the targets. Validation runs over every window of the held-out videos.

    torchrun --nproc_per_node=4 10_superslomo_adobe240.py --train_dir /data/adobe240/train --val_dir /data/adobe240/test
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

WINDOW = 9


def video_dirs(root):
    return sorted(d for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(d))


class WindowDataset(Dataset):
    def __init__(self, root, train=True, size=(352, 352)):
        self.windows = []
        for d in video_dirs(root):
            frames = sorted(glob.glob(os.path.join(d, "*.png")))
            step = 1 if train else WINDOW - 1
            for s in range(0, len(frames) - WINDOW + 1, step):
                self.windows.append(frames[s:s + WINDOW])
        self.train, self.size = train, size

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        imgs = [np.asarray(Image.open(p).convert("RGB")) for p in self.windows[i]]
        x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 255.0  # 9 3 H W
        if self.train:
            _, _, h, w = x.shape
            ch, cw = self.size
            y0, x0 = random.randint(0, h - ch), random.randint(0, w - cw)
            x = x[:, :, y0:y0 + ch, x0:x0 + cw]
            if random.random() < 0.5:
                x = x.flip(0)
            if random.random() < 0.5:
                x = x.flip(-1)
        else:
            h, w = x.shape[-2:]
            x = x[:, :, : h // 32 * 32, : w // 32 * 32]
        return x


class Down(nn.Module):
    def __init__(self, cin, cout, k):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, k, 1, k // 2)
        self.c2 = nn.Conv2d(cout, cout, k, 1, k // 2)

    def forward(self, x):
        x = F.avg_pool2d(x, 2)
        return F.leaky_relu(self.c2(F.leaky_relu(self.c1(x), 0.1)), 0.1)


class Up(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.c2 = nn.Conv2d(2 * cout, cout, 3, 1, 1)

    def forward(self, x, skip):
        x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
        x = F.leaky_relu(self.c1(x), 0.1)
        return F.leaky_relu(self.c2(torch.cat([x, skip], 1)), 0.1)


class UNet(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Conv2d(cin, 32, 7, 1, 3)
        self.c2 = nn.Conv2d(32, 32, 7, 1, 3)
        self.d1, self.d2, self.d3 = Down(32, 64, 5), Down(64, 128, 3), Down(128, 256, 3)
        self.d4, self.d5 = Down(256, 512, 3), Down(512, 512, 3)
        self.u1, self.u2, self.u3 = Up(512, 512), Up(512, 256), Up(256, 128)
        self.u4, self.u5 = Up(128, 64), Up(64, 32)
        self.out = nn.Conv2d(32, cout, 3, 1, 1)

    def forward(self, x):
        s1 = F.leaky_relu(self.c2(F.leaky_relu(self.c1(x), 0.1)), 0.1)
        s2 = self.d1(s1)
        s3 = self.d2(s2)
        s4 = self.d3(s3)
        s5 = self.d4(s4)
        x = self.d5(s5)
        x = self.u1(x, s5)
        x = self.u2(x, s4)
        x = self.u3(x, s3)
        x = self.u4(x, s2)
        x = self.u5(x, s1)
        return self.out(x)


def backwarp(img, flow):
    b, _, h, w = img.shape
    gy, gx = torch.meshgrid(torch.arange(h, device=img.device), torch.arange(w, device=img.device), indexing="ij")
    u = 2 * (gx[None] + flow[:, 0]) / (w - 1) - 1
    v = 2 * (gy[None] + flow[:, 1]) / (h - 1) - 1
    return F.grid_sample(img, torch.stack((u, v), 3), align_corners=True)


class SuperSloMo(nn.Module):
    def __init__(self):
        super().__init__()
        self.flow_comp = UNet(6, 4)
        self.arb_interp = UNet(20, 5)

    def forward(self, i0, i1, t):
        flows = self.flow_comp(torch.cat([i0, i1], 1))
        f01, f10 = flows[:, :2], flows[:, 2:]
        t = t.view(-1, 1, 1, 1)
        ft0 = -(1 - t) * t * f01 + t * t * f10
        ft1 = (1 - t) * (1 - t) * f01 - t * (1 - t) * f10
        g0, g1 = backwarp(i0, ft0), backwarp(i1, ft1)
        out = self.arb_interp(torch.cat([i0, i1, f01, f10, ft1, ft0, g1, g0], 1))
        ft0 = ft0 + out[:, :2]
        ft1 = ft1 + out[:, 2:4]
        v0 = torch.sigmoid(out[:, 4:5])
        v1 = 1 - v0
        g0, g1 = backwarp(i0, ft0), backwarp(i1, ft1)
        pred = ((1 - t) * v0 * g0 + t * v1 * g1) / ((1 - t) * v0 + t * v1 + 1e-8)
        return pred, f01, f10


class VGGPerceptual(nn.Module):
    def __init__(self):
        super().__init__()
        vgg = torchvision.models.vgg16(weights=torchvision.models.VGG16_Weights.IMAGENET1K_V1)
        self.features = nn.Sequential(*list(vgg.features.children())[:22]).eval().requires_grad_(False)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, a, b):
        return F.mse_loss(self.features((a - self.mean) / self.std), self.features((b - self.mean) / self.std))


def smoothness(f):
    return (f[..., 1:, :] - f[..., :-1, :]).abs().mean() + (f[..., :, 1:] - f[..., :, :-1]).abs().mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--val_dir", required=True)
    ap.add_argument("--ckpt_dir", default="ckpt_slomo")
    ap.add_argument("--batch_size", type=int, default=6, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--milestones", default="100,150")
    ap.add_argument("--run_name", default="superslomo-adobe240")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    wandb.init(project="vfi", name=args.run_name, config=vars(args))
    torch.manual_seed(0)

    model = SuperSloMo().to(device)
    model = DDP(model, device_ids=[local_rank])
    vgg = VGGPerceptual().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(m) for m in args.milestones.split(",")], gamma=0.1)

    train_set = WindowDataset(args.train_dir, train=True)
    val_set = WindowDataset(args.val_dir, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True)
    val_idx = list(range(rank, len(val_set), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=1, num_workers=2)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, clip in enumerate(loader):
            clip = clip.to(device, non_blocking=True)
            i0, i1 = clip[:, 0], clip[:, -1]
            k = torch.randint(1, WINDOW - 1, (clip.shape[0],), device=device)
            gt = clip[torch.arange(clip.shape[0], device=device), k]
            t = k.float() / (WINDOW - 1)
            pred, f01, f10 = model(i0, i1, t)
            rec = (pred - gt).abs().mean()
            perc = vgg(pred, gt)
            warp_l = (backwarp(i1, f01) - i0).abs().mean() + (backwarp(i0, f10) - i1).abs().mean()
            smooth = smoothness(f01) + smoothness(f10)
            loss = 204 * rec + 0.005 * perc + 102 * warp_l + smooth
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 100 == 0:
                wandb.log({"loss": loss.item(), "rec": rec.item(), "perc": perc.item(), "warp": warp_l.item(),
                           "epoch": epoch, "lr": sched.get_last_lr()[0]})
        sched.step()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for clip in val_loader:
                clip = clip.to(device)
                for k in range(1, WINDOW - 1):
                    t = torch.full((1,), k / (WINDOW - 1), device=device)
                    pred, _, _ = model.module(clip[:, 0], clip[:, -1], t)
                    mse = F.mse_loss(pred.clamp(0, 1), clip[:, k])
                    acc[0] += -10 * torch.log10(mse)
                    acc[1] += 1
        dist.all_reduce(acc)
        psnr = (acc[0] / acc[1]).item()
        if rank == 0:
            wandb.log({"val/psnr": psnr, "epoch": epoch})
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.ckpt_dir, f"slomo_{epoch:03d}.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
