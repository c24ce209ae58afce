"""
Class-conditional DDPM on Tiny-ImageNet (64x64, 200 classes), single node, processes started
with torch.multiprocessing.spawn. The class embedding is skipped entirely on unconditional
steps (whole-batch condition dropout), as in some CFG implementations.

    python 18_ddpm_mpspawn.py --gpus 8 --data /data/tiny-imagenet-200/train --out runs/tin_ddpm
    python 18_ddpm_mpspawn.py --gpus 8 --data /data/tiny-imagenet-200/train --out runs/tin_ddpm --resume runs/tin_ddpm/last.pt
"""
import argparse
import math
import os
import random
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms


def time_embed(t, dim):
    half = dim // 2
    f = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    a = t.float()[:, None] * f[None]
    return torch.cat([a.sin(), a.cos()], 1)


class Block(nn.Module):
    def __init__(self, cin, cout, edim):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.e = nn.Linear(edim, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.sk = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, e):
        h = self.c1(F.silu(self.n1(x))) + self.e(F.silu(e))[:, :, None, None]
        return self.sk(x) + self.c2(F.silu(self.n2(h)))


class CondUNet(nn.Module):
    def __init__(self, num_classes, ch=128, mults=(1, 2, 2, 4)):
        super().__init__()
        edim = ch * 4
        self.ch = ch
        self.t_mlp = nn.Sequential(nn.Linear(ch, edim), nn.SiLU(), nn.Linear(edim, edim))
        self.class_emb = nn.Embedding(num_classes, edim)
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.enc, self.dec = nn.ModuleList(), nn.ModuleList()
        c, cs = ch, []
        for m in mults:
            self.enc.append(Block(c, ch * m, edim))
            c = ch * m
            cs.append(c)
        self.mid = Block(c, c, edim)
        for m in reversed(mults):
            self.dec.append(Block(c + cs.pop(), ch * m, edim))
            c = ch * m
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x, t, y=None):
        e = self.t_mlp(time_embed(t, self.ch))
        if y is not None:
            e = e + self.class_emb(y)
        h, skips = self.inp(x), []
        for i, blk in enumerate(self.enc):
            h = blk(h, e)
            skips.append(h)
            if i < len(self.enc) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.mid(h, e)
        for i, blk in enumerate(self.dec):
            if i > 0:
                h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = blk(torch.cat([h, skips.pop()], 1), e)
        return self.out(h)


def strip_module_prefix(sd):
    return OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in sd.items())


def worker(rank, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", world_size=args.gpus, rank=rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, num_replicas=args.gpus, rank=rank, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch_size // args.gpus, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    net = CondUNet(len(ds.classes)).to(device)
    ema = CondUNet(len(ds.classes)).to(device).requires_grad_(False).eval()
    ema.load_state_dict(net.state_dict())
    start_epoch = 0
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    if args.resume:
        ckpt = torch.load(args.resume, map_location={"cuda:0": f"cuda:{rank}"})
        net.load_state_dict(strip_module_prefix(ckpt["model"]))
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch = ckpt["epoch"] + 1
    # class_emb gets no gradient on the unconditional steps
    model = DDP(net, device_ids=[rank], find_unused_parameters=True)

    betas = torch.linspace(1e-4, 0.02, 1000, device=device)
    abar = torch.cumprod(1 - betas, 0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = start_epoch * len(dl)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        run = torch.zeros(2, device=device)
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            cond = y if random.random() >= args.p_uncond else None
            t = torch.randint(0, 1000, (x.shape[0],), device=device)
            eps = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1)
            loss = F.mse_loss(model(a.sqrt() * x + (1 - a).sqrt() * eps, t, cond), eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.mul_(args.ema).add_(p, alpha=1 - args.ema)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1

        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch} step {step} loss {(run[0] / run[1]).item():.4f} {time.time() - tic:.0f}s", flush=True)
            torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/ddpm")
    ap.add_argument("--resume", default="")
    ap.add_argument("--batch_size", type=int, default=512, help="global")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--port", type=str, default="29513")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    mp.spawn(worker, args=(args,), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
