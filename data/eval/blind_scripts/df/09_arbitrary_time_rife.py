"""Arbitrary-time interpolation (RIFE v4 style, timestep as an input channel) trained on Vimeo-90K septuplets:
frames 1 and 7 are the inputs, one of frames 2..6 is the target with t = (k - 1) / 6.

    torchrun --nproc_per_node=8 09_arbitrary_time_rife.py --cfg configs/rife_t.yaml
    torchrun --nproc_per_node=8 09_arbitrary_time_rife.py --cfg configs/rife_t.yaml --resume out/rife_t/last.pth
"""
import argparse
import copy
import math
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(root="/data/vimeo_septuplet", out="out/rife_t", batch_size=64, lr=2e-4, min_lr=2e-6, warmup=2000,
                epochs=200, crop=256, workers=8, ema_decay=0.999, pretrained="", eval_every=2)


class SeptupletArbitraryT(Dataset):
    def __init__(self, root, list_name, train, crop):
        with open(os.path.join(root, list_name)) as f:
            self.seqs = [l.strip() for l in f if l.strip()]
        self.root, self.train, self.crop = os.path.join(root, "sequences"), train, crop

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        d = os.path.join(self.root, self.seqs[i])
        k = random.randint(2, 6) if self.train else 4
        ims = [cv2.imread(os.path.join(d, f"im{j}.png"))[:, :, ::-1] for j in (1, k, 7)]
        t = (k - 1) / 6.0
        if self.train:
            h, w = ims[0].shape[:2]
            y, x = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            ims = [im[y:y + self.crop, x:x + self.crop] for im in ims]
            if random.random() < 0.5:
                ims = [im[:, ::-1] for im in ims]
            if random.random() < 0.5:
                ims, t = ims[::-1], 1.0 - t
        x = np.concatenate([np.ascontiguousarray(im) for im in ims], 2)
        return torch.from_numpy(x).permute(2, 0, 1).float() / 255.0, torch.tensor([t], dtype=torch.float32)


def conv(i, o, k=3, s=1, p=1):
    return nn.Sequential(nn.Conv2d(i, o, k, s, p), nn.LeakyReLU(0.2, True))


def warp(img, flow):
    b, _, h, w = flow.shape
    hor = torch.linspace(-1.0, 1.0, w, device=flow.device).view(1, 1, 1, w).expand(b, -1, h, -1)
    ver = torch.linspace(-1.0, 1.0, h, device=flow.device).view(1, 1, h, 1).expand(b, -1, -1, w)
    flow = torch.cat([flow[:, 0:1] / ((w - 1.0) / 2.0), flow[:, 1:2] / ((h - 1.0) / 2.0)], 1)
    return F.grid_sample(img, (torch.cat([hor, ver], 1) + flow).permute(0, 2, 3, 1), mode="bilinear",
                         padding_mode="border", align_corners=True)


class IFBlockT(nn.Module):
    def __init__(self, cin, c):
        super().__init__()
        self.conv0 = nn.Sequential(conv(cin, c // 2, 3, 2, 1), conv(c // 2, c, 3, 2, 1))
        self.body = nn.Sequential(*[conv(c, c) for _ in range(8)])
        self.last = nn.ConvTranspose2d(c, 4 * 6, 4, 2, 1)

    def forward(self, x, scale):
        x = F.interpolate(x, scale_factor=1.0 / scale, mode="bilinear", align_corners=False)
        x = self.conv0(x)
        x = self.body(x) + x
        x = F.pixel_shuffle(self.last(x), 2)  # 6 channels at 1/scale
        x = F.interpolate(x, scale_factor=scale, mode="bilinear", align_corners=False)
        return x[:, :4] * scale, x[:, 4:5], x[:, 5:6]


class RIFET(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([IFBlockT(7, 192), IFBlockT(7 + 6 + 4 + 1, 128),
                                     IFBlockT(7 + 6 + 4 + 1, 96), IFBlockT(7 + 6 + 4 + 1, 64)])
        self.scales = (8, 4, 2, 1)

    def forward(self, img0, img1, t):
        tmap = t.view(-1, 1, 1, 1).expand(-1, 1, *img0.shape[-2:])
        flow = mask = None
        outs = []
        for blk, s in zip(self.blocks, self.scales):
            if flow is None:
                flow, mask, _ = blk(torch.cat([img0, img1, tmap], 1), s)
            else:
                w0, w1 = warp(img0, flow[:, :2]), warp(img1, flow[:, 2:4])
                df, dm, _ = blk(torch.cat([img0, img1, tmap, w0, w1, flow, mask], 1), s)
                flow, mask = flow + df, mask + dm
            m = torch.sigmoid(mask)
            outs.append(warp(img0, flow[:, :2]) * m + warp(img1, flow[:, 2:4]) * (1 - m))
        return outs


def laplacian_l1(pred, gt, levels=4):
    loss = 0.0
    for _ in range(levels):
        dp, dg = F.avg_pool2d(pred, 2), F.avg_pool2d(gt, 2)
        loss = loss + (pred - F.interpolate(dp, scale_factor=2.0) - (gt - F.interpolate(dg, scale_factor=2.0))).abs().mean()
        pred, gt = dp, dg
    return loss + (pred - gt).abs().mean()


class Trainer:
    def __init__(self, cfg, local_rank):
        self.cfg, self.local_rank = cfg, local_rank
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", local_rank)
        net = RIFET().to(self.device)
        if cfg["pretrained"]:
            net.load_state_dict(torch.load(cfg["pretrained"], map_location="cpu"), strict=False)
        self.ema = copy.deepcopy(net).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(net.parameters(), lr=cfg["lr"], weight_decay=1e-4)
        self.net = DDP(net, device_ids=[local_rank], output_device=local_rank)
        self.epoch, self.step, self.best = 0, 0, 0.0

    def lr_at(self, step, total):
        c = self.cfg
        if step < c["warmup"]:
            return c["lr"] * step / c["warmup"]
        prog = (step - c["warmup"]) / max(1, total - c["warmup"])
        return c["min_lr"] + 0.5 * (c["lr"] - c["min_lr"]) * (1 + math.cos(math.pi * prog))

    def save(self, name):
        if self.rank != 0:
            return
        os.makedirs(self.cfg["out"], exist_ok=True)
        torch.save({"net": self.net.module.state_dict(), "ema": self.ema.state_dict(), "opt": self.opt.state_dict(),
                    "epoch": self.epoch, "step": self.step, "best": self.best},
                   os.path.join(self.cfg["out"], name))

    def resume(self, path):
        ckpt = torch.load(path)
        self.net.module.load_state_dict(ckpt["net"])
        self.ema.load_state_dict(ckpt["ema"])
        self.opt.load_state_dict(ckpt["opt"])
        self.epoch, self.step, self.best = ckpt["epoch"] + 1, ckpt["step"], ckpt["best"]

    @torch.no_grad()
    def evaluate(self, dataset):
        shard = Subset(dataset, range(self.rank, len(dataset), self.world))
        loader = DataLoader(shard, batch_size=8, num_workers=4, pin_memory=True)
        acc = torch.zeros(2, device=self.device)
        for x, t in loader:
            x, t = x.to(self.device), t.to(self.device)
            pred = self.ema(x[:, 0:3], x[:, 6:9], t)[-1]
            mse = ((pred - x[:, 3:6]) ** 2).mean((1, 2, 3))
            acc[0] += (-10 * torch.log10(mse)).sum()
            acc[1] += x.shape[0]
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    def fit(self, train_set, test_set):
        c = self.cfg
        sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
        loader = DataLoader(train_set, batch_size=c["batch_size"] // self.world, sampler=sampler,
                            num_workers=c["workers"], pin_memory=True, drop_last=True, persistent_workers=True)
        total = c["epochs"] * len(loader)
        writer = SummaryWriter(os.path.join(c["out"], "tb")) if self.rank == 0 else None
        for epoch in range(self.epoch, c["epochs"]):
            self.epoch = epoch
            sampler.set_epoch(epoch)
            self.net.train()
            t0 = time.time()
            for x, t in loader:
                x, t = x.to(self.device, non_blocking=True), t.to(self.device, non_blocking=True)
                lr = self.lr_at(self.step, total)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                outs = self.net(x[:, 0:3], x[:, 6:9], t)
                gt = x[:, 3:6]
                loss = laplacian_l1(outs[-1], gt) + 0.25 * sum(laplacian_l1(o, gt) for o in outs[:-1])
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
                with torch.no_grad():
                    for pe, p in zip(self.ema.parameters(), self.net.module.parameters()):
                        pe.mul_(c["ema_decay"]).add_(p, alpha=1 - c["ema_decay"])
                self.step += 1
                if writer is not None and self.step % 100 == 0:
                    writer.add_scalar("loss", loss.item(), self.step)
                    writer.add_scalar("lr", lr, self.step)
            if self.rank == 0:
                print(f"epoch {epoch} {time.time() - t0:.0f}s loss {loss.item():.4f}", flush=True)
            if (epoch + 1) % c["eval_every"] == 0:
                psnr = self.evaluate(test_set)
                if writer is not None:
                    writer.add_scalar("test/psnr_t0.5", psnr, epoch)
                    print(f"epoch {epoch} sep-test PSNR (t=0.5) {psnr:.3f}", flush=True)
                if psnr > self.best:
                    self.best = psnr
                    self.save("best.pth")
            self.save("last.pth")
            dist.barrier()
        if writer is not None:
            writer.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.cfg:
        with open(args.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    seed = 17 + dist.get_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(17)

    trainer = Trainer(cfg, local_rank)
    if args.resume:
        trainer.resume(args.resume)
    train_set = SeptupletArbitraryT(cfg["root"], "sep_trainlist.txt", True, cfg["crop"])
    test_set = SeptupletArbitraryT(cfg["root"], "sep_testlist.txt", False, cfg["crop"])
    trainer.fit(train_set, test_set)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
