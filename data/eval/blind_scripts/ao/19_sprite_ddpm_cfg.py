# Class-conditional DDPM for 32x32 pixel-art sprites (16 character classes), CFG sampling.
#
#   torchrun --nproc_per_node=2 sprite_ddpm.py --data data/sprites_32.npz --out out/sprites
import argparse
import copy
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


class Diffusion:
    def __init__(self, T=500, beta1=1e-4, beta2=0.02, device=DEVICE):
        self.T = T
        self.betas = torch.linspace(beta1, beta2, T + 1, device=device)
        self.alphas = 1 - self.betas
        self.abar = torch.cumprod(self.alphas, 0)
        self.abar[0] = 1.0

    def noise(self, x, t):
        eps = torch.randn_like(x)
        a = self.abar[t][:, None, None, None]
        return a.sqrt() * x + (1 - a).sqrt() * eps, eps

    @torch.no_grad()
    def sample(self, net, c, guide_w=2.0, size=32):
        n = len(c)
        x = torch.randn(n, 3, size, size, device=c.device)
        c_in = torch.cat([c, torch.full_like(c, net.n_classes)])
        for i in range(self.T, 0, -1):
            t = torch.full((2 * n,), i, device=c.device, dtype=torch.long)
            eps = net(torch.cat([x, x]), t.float() / self.T, c_in)
            e_c, e_u = eps.chunk(2)
            eps = (1 + guide_w) * e_c - guide_w * e_u
            z = torch.randn_like(x) if i > 1 else 0
            x = (x - eps * self.betas[i] / (1 - self.abar[i]).sqrt()) / self.alphas[i].sqrt() + self.betas[i].sqrt() * z
        return x


class ResConv(nn.Module):
    def __init__(self, ci, co):
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv2d(ci, co, 3, 1, 1), nn.GroupNorm(8, co), nn.GELU())
        self.c2 = nn.Sequential(nn.Conv2d(co, co, 3, 1, 1), nn.GroupNorm(8, co), nn.GELU())
        self.sk = nn.Conv2d(ci, co, 1) if ci != co else nn.Identity()

    def forward(self, x):
        return (self.sk(x) + self.c2(self.c1(x))) / 1.414


class EmbedFC(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(i, o), nn.GELU(), nn.Linear(o, o))

    def forward(self, x):
        return self.net(x)


class ContextUnet(nn.Module):
    def __init__(self, n_feat=128, n_classes=16):
        super().__init__()
        self.n_classes = n_classes
        self.init = ResConv(3, n_feat)
        self.down1 = nn.Sequential(ResConv(n_feat, n_feat), nn.MaxPool2d(2))
        self.down2 = nn.Sequential(ResConv(n_feat, 2 * n_feat), nn.MaxPool2d(2))
        self.down3 = nn.Sequential(ResConv(2 * n_feat, 2 * n_feat), nn.MaxPool2d(2))
        self.to_vec = nn.Sequential(nn.AvgPool2d(4), nn.GELU())
        self.t1, self.t2, self.t3 = EmbedFC(1, 2 * n_feat), EmbedFC(1, 2 * n_feat), EmbedFC(1, n_feat)
        self.c_emb = nn.Embedding(n_classes + 1, 2 * n_feat)
        self.c2, self.c3 = EmbedFC(2 * n_feat, 2 * n_feat), EmbedFC(2 * n_feat, n_feat)
        self.up0 = nn.Sequential(nn.ConvTranspose2d(2 * n_feat, 2 * n_feat, 4, 4), nn.GroupNorm(8, 2 * n_feat), nn.ReLU())
        self.up1 = nn.Sequential(nn.ConvTranspose2d(4 * n_feat, 2 * n_feat, 2, 2), ResConv(2 * n_feat, 2 * n_feat))
        self.up2 = nn.Sequential(nn.ConvTranspose2d(4 * n_feat, n_feat, 2, 2), ResConv(n_feat, n_feat))
        self.up3 = nn.Sequential(nn.ConvTranspose2d(2 * n_feat, n_feat, 2, 2), ResConv(n_feat, n_feat))
        self.out = nn.Sequential(nn.Conv2d(2 * n_feat, n_feat, 3, 1, 1), nn.GroupNorm(8, n_feat), nn.ReLU(),
                                 nn.Conv2d(n_feat, 3, 3, 1, 1))

    def forward(self, x, t, c):
        x0 = self.init(x)
        d1 = self.down1(x0)
        d2 = self.down2(d1)
        d3 = self.down3(d2)
        v = self.to_vec(d3)
        t = t[:, None]
        ce = self.c_emb(c)
        h = self.up0(v)
        h = self.up1(torch.cat([h * (1 + ce[:, :, None, None]) + self.t1(t)[:, :, None, None], d3], 1))
        h = self.up2(torch.cat([h * (1 + self.c2(ce)[:, :, None, None]) + self.t2(t)[:, :, None, None], d2], 1))
        h = self.up3(torch.cat([h * (1 + self.c3(ce)[:, :, None, None]) + self.t3(t)[:, :, None, None], d1], 1))
        return self.out(torch.cat([h, x0], 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="npz with images (N,32,32,3 uint8) and labels")
    ap.add_argument("--out", default="out/sprites")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--drop_prob", type=float, default=0.1)
    ap.add_argument("--save_every", type=int, default=20)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    d = np.load(args.data)
    imgs = torch.from_numpy(d["images"]).permute(0, 3, 1, 2).float() / 127.5 - 1
    labels = torch.from_numpy(d["labels"]).long()
    n_classes = int(labels.max()) + 1
    ds = TensorDataset(imgs, labels)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=2, drop_last=True)

    net = ContextUnet(n_classes=n_classes).to(device)
    ema = copy.deepcopy(net).eval()
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ck["net"]); ema.load_state_dict(ck["ema"]); opt.load_state_dict(ck["opt"])
        start = ck["epoch"] + 1
    net = DDP(net, device_ids=[local_rank])
    diff = Diffusion()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for ep in range(start, args.epochs):
        sampler.set_epoch(ep)
        net.train()
        # linear lr decay like the original notebook
        for g in opt.param_groups:
            g["lr"] = args.lr * (1 - ep / args.epochs)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, c in dl:
            x, c = x.to(device), c.to(device)
            c = torch.where(torch.rand(c.shape, device=device) < args.drop_prob, torch.full_like(c, n_classes), c)
            t = torch.randint(1, diff.T + 1, (x.size(0),), device=device)
            x_t, eps = diff.noise(x, t)
            loss = F.mse_loss(net(x_t, t.float() / diff.T, c), eps)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.module.parameters()):
                    pe.mul_(0.995).add_(p, alpha=0.005)
            tot += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])

        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {ep} loss {(tot[0] / tot[1]).item():.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.time() - t0:.1f}s", flush=True)
            if ep % args.save_every == 0 or ep == args.epochs - 1:
                c = torch.arange(n_classes, device=device).repeat(4)
                xs = diff.sample(ema, c)
                save_image(xs * 0.5 + 0.5, os.path.join(args.out, f"ep{ep:03d}.png"), nrow=n_classes)
                torch.save({"net": net.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                            "epoch": ep}, os.path.join(args.out, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
