"""EMA-VFI-like interpolation: CNN stem + windowed inter-frame cross attention at 1/8 resolution, coarse-to-fine
flow / mask heads, weight EMA via timm's ModelEmaV2.

    torchrun --nproc_per_node=8 17_interframe_attention_vfi.py --data /data/vimeo_triplet --output_dir output/ifa_vfi
"""
import argparse
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output_dir", default="output/ifa_vfi")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=32, help="global")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--ema_decay", type=float, default=0.9998)
    p.add_argument("--resume", default="")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class VimeoTriplet(Dataset):
    def __init__(self, root, train):
        lst = "tri_trainlist.txt" if train else "tri_testlist.txt"
        self.paths = [os.path.join(root, "sequences", l.strip()) for l in open(os.path.join(root, lst)) if l.strip()]
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        ims = np.stack([np.array(Image.open(f"{self.paths[i]}/im{k}.png").convert("RGB")) for k in (1, 2, 3)])
        if self.train:
            y, x = random.randint(0, ims.shape[1] - 256), random.randint(0, ims.shape[2] - 256)
            ims = ims[:, y:y + 256, x:x + 256]
            if random.random() < 0.5:
                ims = ims[:, ::-1]
            if random.random() < 0.5:
                ims = ims[:, :, ::-1]
            if random.random() < 0.5:
                ims = ims[::-1]
        return torch.from_numpy(np.ascontiguousarray(ims)).permute(0, 3, 1, 2).float().div(255.0)


def conv(i, o, s=1):
    return nn.Sequential(nn.Conv2d(i, o, 3, s, 1), nn.PReLU(o))


class WindowCrossAttention(nn.Module):
    def __init__(self, dim, heads=4, window=8):
        super().__init__()
        self.heads, self.window = heads, window
        self.norm_q, self.norm_kv = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.kv, self.proj = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def _windows(self, x):
        b, c, h, w = x.shape
        ws = self.window
        x = x.view(b, c, h // ws, ws, w // ws, ws).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(-1, ws * ws, c)

    def _merge(self, x, b, c, h, w):
        ws = self.window
        x = x.view(b, h // ws, w // ws, ws, ws, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, c, h, w)

    def forward(self, a, bfeat):
        b, c, h, w = a.shape
        qa, kvb = self._windows(a), self._windows(bfeat)
        q = self.q(self.norm_q(qa))
        k, v = self.kv(self.norm_kv(kvb)).chunk(2, -1)
        split = lambda t: t.view(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).flatten(2)
        x = qa + self.proj(o)
        x = x + self.mlp(x)
        return self._merge(x, b, c, h, w)


def warp(img, flow):
    b, _, h, w = flow.shape
    gy, gx = torch.meshgrid(torch.linspace(-1, 1, h, device=flow.device), torch.linspace(-1, 1, w, device=flow.device),
                            indexing="ij")
    grid = torch.stack([gx, gy], -1)[None] + torch.stack([flow[:, 0] * 2 / (w - 1), flow[:, 1] * 2 / (h - 1)], -1)
    return F.grid_sample(img, grid, align_corners=True, padding_mode="border")


class Head(nn.Module):
    def __init__(self, cin, c):
        super().__init__()
        self.body = nn.Sequential(conv(cin, c), conv(c, c), conv(c, c), nn.ConvTranspose2d(c, 5, 4, 2, 1))

    def forward(self, x):
        return self.body(x)


class IFAVFI(nn.Module):
    def __init__(self, dim=128):
        super().__init__()
        self.stem = nn.Sequential(conv(3, 32, 2), conv(32, 32), conv(32, 64, 2), conv(64, 64), conv(64, dim, 2), conv(dim, dim))
        self.attn = nn.ModuleList([WindowCrossAttention(dim) for _ in range(2)])
        self.head8 = Head(4 * dim, 192)
        self.head4 = Head(3 * 4 + 1 + 4, 96)
        self.head2 = Head(3 * 4 + 1 + 4, 64)

    def forward(self, i0, i1):
        b = i0.shape[0]
        f = self.stem(torch.cat([i0, i1]))
        fa, fb = f[:b], f[b:]
        ma, mb = fa, fb
        for blk in self.attn:
            ma, mb = blk(ma, fb), blk(mb, fa)
        out = self.head8(torch.cat([fa, fb, ma, mb], 1))  # 1/4
        flow = F.interpolate(out[:, :4], scale_factor=4.0, mode="bilinear", align_corners=False) * 4
        mask = F.interpolate(out[:, 4:5], scale_factor=4.0, mode="bilinear", align_corners=False)
        preds = []
        for head, s in ((self.head4, 4), (self.head2, 2)):
            w0, w1 = warp(i0, flow[:, :2]), warp(i1, flow[:, 2:])
            preds.append(torch.sigmoid(mask) * w0 + (1 - torch.sigmoid(mask)) * w1)
            x = torch.cat([i0, i1, w0, w1, mask, flow], 1)
            x = F.interpolate(x, scale_factor=1.0 / s, mode="bilinear", align_corners=False)
            d = head(x)
            flow = flow + F.interpolate(d[:, :4], scale_factor=s / 2, mode="bilinear", align_corners=False) * (s / 2)
            mask = mask + F.interpolate(d[:, 4:5], scale_factor=s / 2, mode="bilinear", align_corners=False)
        w0, w1 = warp(i0, flow[:, :2]), warp(i1, flow[:, 2:])
        m = torch.sigmoid(mask)
        preds.append(m * w0 + (1 - m) * w1)
        return preds


def save_checkpoint(state, is_best, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "checkpoint.pth")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth"))


@torch.no_grad()
def validate(model, ds, device, rank, world):
    model.eval()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=8, num_workers=4, pin_memory=True)
    tot = torch.zeros(2, device=device)
    for x in loader:
        x = x.to(device, non_blocking=True)
        pred = model(x[:, 0], x[:, 2])[-1]
        mse = (pred - x[:, 1]).pow(2).flatten(1).mean(1)
        tot[0] += (-10 * torch.log10(mse)).sum()
        tot[1] += x.shape[0]
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(3407)

    net = IFAVFI().to(device)
    ema = ModelEmaV2(net, decay=args.ema_decay)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.wd)
    start_epoch, best_psnr = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ck["model"])
        ema.module.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["optimizer"])
        start_epoch, best_psnr = ck["epoch"] + 1, ck["best_psnr"]
    model = DDP(net, device_ids=[local_rank])

    train_set, test_set = VimeoTriplet(args.data, True), VimeoTriplet(args.data, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=args.lr * 0.01)
    for _ in range(start_epoch * len(loader)):
        sched.step()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), 0.0
        for i, x in enumerate(loader):
            x = x.to(device, non_blocking=True)
            preds = model(x[:, 0], x[:, 2])
            gt = x[:, 1]
            loss = sum(w * (p - gt).abs().mean() for w, p in zip((0.25, 0.5, 1.0), preds))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ema.update(net)
            run += loss.item()
            if rank == 0 and (i + 1) % 100 == 0:
                print(f"[{epoch}][{i + 1}/{len(loader)}] loss {run / 100:.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)
                run = 0.0

        psnr = validate(ema.module, test_set, device, rank, world)
        is_best = psnr > best_psnr
        best_psnr = max(psnr, best_psnr)
        if rank == 0:
            print(f"epoch {epoch}: EMA PSNR {psnr:.3f} (best {best_psnr:.3f})", flush=True)
        save_checkpoint({"epoch": epoch, "model": net.state_dict(), "ema": ema.module.state_dict(),
                         "optimizer": opt.state_dict(), "best_psnr": best_psnr}, is_best, args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
