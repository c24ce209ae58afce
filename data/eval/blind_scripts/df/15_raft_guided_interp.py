"""Frame interpolation driven by a RAFT-style recurrent flow estimator (all-pairs correlation + ConvGRU),
trained end-to-end on Vimeo-90K triplets. Bidirectional flows are estimated in one batched pass and
turned into intermediate flows with the linear-motion approximation, then refined by a small fusion net.

    torchrun --nproc_per_node=8 15_raft_guided_interp.py --vimeo /data/vimeo_triplet --iters 12 --grad_ckpt
"""
import argparse
import math
import os
import random

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class Vimeo(Dataset):
    def __init__(self, root, split, crop=256):
        with open(os.path.join(root, f"tri_{split}list.txt")) as f:
            self.names = [n.strip() for n in f if n.strip()]
        self.root, self.train, self.crop = root, split == "train", crop

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        d = os.path.join(self.root, "sequences", self.names[i])
        x = np.stack([cv2.cvtColor(cv2.imread(f"{d}/im{k}.png"), cv2.COLOR_BGR2RGB) for k in (1, 2, 3)])
        if self.train:
            h, w = x.shape[1:3]
            y0, x0 = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            x = x[:, y0:y0 + self.crop, x0:x0 + self.crop]
            if random.random() < 0.5:
                x = x[:, :, ::-1]
            if random.random() < 0.5:
                x = x[::-1]
        return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).float() / 255.0


class ResidualBlock(nn.Module):
    def __init__(self, cin, cout, norm, stride=1):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.n1, self.n2 = norm(cout), norm(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1, stride), norm(cout))

    def forward(self, x):
        y = F.relu(self.n1(self.c1(x)))
        y = F.relu(self.n2(self.c2(y)))
        return F.relu((x if self.down is None else self.down(x)) + y)


class Encoder(nn.Module):
    def __init__(self, out_dim, norm):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3), norm(64), nn.ReLU(inplace=True))
        self.layers = nn.Sequential(ResidualBlock(64, 64, norm), ResidualBlock(64, 96, norm, 2),
                                    ResidualBlock(96, 96, norm), ResidualBlock(96, 128, norm, 2),
                                    ResidualBlock(128, 128, norm))
        self.out = nn.Conv2d(128, out_dim, 1)

    def forward(self, x):
        return self.out(self.layers(self.stem(x * 2 - 1)))


class CorrPyramid:
    def __init__(self, f1, f2, levels=4, radius=4):
        b, d, h, w = f1.shape
        corr = torch.einsum("bdn,bdm->bnm", f1.flatten(2), f2.flatten(2)) / math.sqrt(d)
        corr = corr.reshape(b * h * w, 1, h, w)
        self.pyr = [corr]
        for _ in range(levels - 1):
            corr = F.avg_pool2d(corr, 2)
            self.pyr.append(corr)
        r = torch.linspace(-radius, radius, 2 * radius + 1, device=f1.device)
        dy, dx = torch.meshgrid(r, r, indexing="ij")
        self.delta = torch.stack([dx, dy], -1).view(1, 2 * radius + 1, 2 * radius + 1, 2)

    def __call__(self, coords):
        b, _, h, w = coords.shape
        c = coords.permute(0, 2, 3, 1).reshape(b * h * w, 1, 1, 2)
        out = []
        for i, corr in enumerate(self.pyr):
            pts = c / 2 ** i + self.delta
            hh, ww = corr.shape[-2:]
            grid = torch.stack([2 * pts[..., 0] / max(ww - 1, 1) - 1, 2 * pts[..., 1] / max(hh - 1, 1) - 1], -1)
            out.append(F.grid_sample(corr, grid, align_corners=True).view(b, h, w, -1))
        return torch.cat(out, -1).permute(0, 3, 1, 2).contiguous()


class UpdateBlock(nn.Module):
    def __init__(self, hdim=128, cdim=128, corr_ch=4 * 81):
        super().__init__()
        self.convc1, self.convc2 = nn.Conv2d(corr_ch, 256, 1), nn.Conv2d(256, 192, 3, 1, 1)
        self.convf1, self.convf2 = nn.Conv2d(2, 128, 7, 1, 3), nn.Conv2d(128, 64, 3, 1, 1)
        self.conv = nn.Conv2d(192 + 64, 126, 3, 1, 1)
        self.convz = nn.Conv2d(hdim + cdim + 128, hdim, 3, 1, 1)
        self.convr = nn.Conv2d(hdim + cdim + 128, hdim, 3, 1, 1)
        self.convq = nn.Conv2d(hdim + cdim + 128, hdim, 3, 1, 1)
        self.head = nn.Sequential(nn.Conv2d(hdim, 256, 3, 1, 1), nn.ReLU(inplace=True), nn.Conv2d(256, 2, 3, 1, 1))

    def forward(self, net, inp, corr, flow):
        c = F.relu(self.convc2(F.relu(self.convc1(corr))))
        f = F.relu(self.convf2(F.relu(self.convf1(flow))))
        motion = torch.cat([F.relu(self.conv(torch.cat([c, f], 1))), flow], 1)
        x = torch.cat([inp, motion], 1)
        hx = torch.cat([net, x], 1)
        z, r = torch.sigmoid(self.convz(hx)), torch.sigmoid(self.convr(hx))
        q = torch.tanh(self.convq(torch.cat([r * net, x], 1)))
        net = (1 - z) * net + z * q
        return net, self.head(net)


def backwarp(img, flow):
    b, _, h, w = flow.shape
    yy, xx = torch.meshgrid(torch.arange(h, device=flow.device), torch.arange(w, device=flow.device), indexing="ij")
    gx = 2 * (xx + flow[:, 0]) / (w - 1) - 1
    gy = 2 * (yy + flow[:, 1]) / (h - 1) - 1
    return F.grid_sample(img, torch.stack([gx, gy], -1), align_corners=True, padding_mode="border")


class RAFTInterp(nn.Module):
    def __init__(self, iters=12, grad_ckpt=False):
        super().__init__()
        self.iters, self.grad_ckpt = iters, grad_ckpt
        self.fnet = Encoder(256, nn.InstanceNorm2d)
        self.cnet = Encoder(256, lambda c: nn.GroupNorm(8, c))
        self.update = UpdateBlock()
        self.fusion = nn.Sequential(nn.Conv2d(3 * 4 + 4, 64, 3, 1, 1), nn.PReLU(64), nn.Conv2d(64, 64, 3, 1, 1),
                                    nn.PReLU(64), nn.Conv2d(64, 4, 3, 1, 1))

    def bidirectional_flow(self, i0, i1):
        a, b = torch.cat([i0, i1]), torch.cat([i1, i0])
        f1, f2 = self.fnet(torch.cat([a, b])).float().chunk(2)
        corr_fn = CorrPyramid(f1, f2)
        net, inp = self.cnet(a).split(128, 1)
        net, inp = torch.tanh(net), F.relu(inp)
        n, _, h, w = f1.shape
        yy, xx = torch.meshgrid(torch.arange(h, device=a.device), torch.arange(w, device=a.device), indexing="ij")
        coords0 = torch.stack([xx, yy]).float()[None].expand(n, -1, -1, -1)
        coords1 = coords0.clone()
        for _ in range(self.iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            flow = coords1 - coords0
            if self.grad_ckpt and self.training:
                net, delta = checkpoint(self.update, net, inp, corr, flow)
            else:
                net, delta = self.update(net, inp, corr, flow)
            coords1 = coords1 + delta
        flow = 8 * F.interpolate(coords1 - coords0, scale_factor=8, mode="bilinear", align_corners=True)
        return flow.chunk(2)  # flow 0->1, flow 1->0

    def forward(self, i0, i1):
        f01, f10 = self.bidirectional_flow(i0, i1)
        ft0 = -0.25 * f01 + 0.25 * f10
        ft1 = 0.25 * f01 - 0.25 * f10
        w0, w1 = backwarp(i0, ft0), backwarp(i1, ft1)
        out = self.fusion(torch.cat([i0, i1, w0, w1, ft0, ft1], 1))
        m = torch.sigmoid(out[:, :1])
        return (m * w0 + (1 - m) * w1 + out[:, 1:]).clamp(0, 1), f01, f10


@torch.no_grad()
def test_psnr(net, ds, device, rank, world):
    net.eval()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=4, num_workers=4)
    s = torch.zeros(2, device=device)
    for x in loader:
        x = x.to(device)
        pred, _, _ = net(x[:, 0], x[:, 2])
        mse = ((pred - x[:, 1]) ** 2).mean((1, 2, 3))
        s += torch.stack([(-10 * mse.log10()).sum(), torch.tensor(float(len(mse)), device=device)])
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vimeo", required=True)
    ap.add_argument("--save", default="ckpt_raft_interp")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--batch_size", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=80)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)
    random.seed(1 + rank)

    net = RAFTInterp(args.iters, args.grad_ckpt).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5, eps=1e-8)

    train_set, test_set = Vimeo(args.vimeo, "train"), Vimeo(args.vimeo, "test")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * len(loader) + 100,
                                                pct_start=0.05, anneal_strategy="linear")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, x in enumerate(loader):
            x = x.to(device, non_blocking=True)
            i0, gt, i1 = x[:, 0], x[:, 1], x[:, 2]
            pred, f01, f10 = model(i0, i1)
            rec = (pred - gt).abs().mean()
            photo = (backwarp(i1, f01) - i0).abs().mean() + (backwarp(i0, f10) - i1).abs().mean()
            loss = rec + 0.1 * photo
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} rec {rec.item():.4f} photo {photo.item():.4f}", flush=True)

        psnr = test_psnr(net, test_set, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} Vimeo test PSNR {psnr:.3f}", flush=True)
            os.makedirs(args.save, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.save, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
