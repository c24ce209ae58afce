# -*- coding: utf-8 -*-
"""
DDPM 在 CIFAR-10 上的训练 (简化版 UNet)
多卡:  torchrun --nproc_per_node=4 train_ddpm.py --out runs/ddpm_cifar
"""
import os
import copy
import math
import time
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets, transforms
from torchvision.utils import save_image
from easydict import EasyDict
from torch.utils.tensorboard import SummaryWriter

CFG = EasyDict(
    T=1000, beta_1=1e-4, beta_T=0.02,
    ch=128, ch_mult=(1, 2, 2, 2), dropout=0.1,
    lr=2e-4, batch_size=32,  # 每张卡 32, 4 卡总 batch 128 与论文一致
    total_steps=800000, warmup=5000, grad_clip=1.0, ema_decay=0.9999,
    sample_every=5000, save_every=10000, log_every=100,
)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="runs/ddpm_cifar")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--resume", default="")
    return p.parse_args()


# ---------------------------- 模型 ----------------------------
def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch, tdim, dropout):
        super().__init__()
        self.block1 = nn.Sequential(nn.GroupNorm(32, in_ch), nn.SiLU(), nn.Conv2d(in_ch, out_ch, 3, 1, 1))
        self.temb = nn.Sequential(nn.SiLU(), nn.Linear(tdim, out_ch))
        self.block2 = nn.Sequential(nn.GroupNorm(32, out_ch), nn.SiLU(), nn.Dropout(dropout),
                                    nn.Conv2d(out_ch, out_ch, 3, 1, 1))
        self.shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x, temb):
        h = self.block1(x)
        h = h + self.temb(temb)[:, :, None, None]
        h = self.block2(h)
        return h + self.shortcut(x)


class UNet(nn.Module):
    def __init__(self, ch=128, ch_mult=(1, 2, 2, 2), dropout=0.1):
        super().__init__()
        tdim = ch * 4
        self.ch = ch
        self.time_mlp = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.head = nn.Conv2d(3, ch, 3, 1, 1)
        self.downs = nn.ModuleList()
        chs, now = [ch], ch
        for i, m in enumerate(ch_mult):
            out = ch * m
            self.downs.append(ResBlock(now, out, tdim, dropout))
            now = out
            chs.append(now)
            if i != len(ch_mult) - 1:
                self.downs.append(nn.Conv2d(now, now, 3, 2, 1))
                chs.append(now)
        self.mid = ResBlock(now, now, tdim, dropout)
        self.ups = nn.ModuleList()
        for i, m in reversed(list(enumerate(ch_mult))):
            out = ch * m
            self.ups.append(ResBlock(chs.pop() + now, out, tdim, dropout))
            now = out
            if i != 0:
                self.ups.append(nn.Upsample(scale_factor=2, mode="nearest"))
        self.tail = nn.Sequential(nn.GroupNorm(32, now), nn.SiLU(), nn.Conv2d(now, 3, 3, 1, 1))

    def forward(self, x, t):
        temb = self.time_mlp(timestep_embedding(t, self.ch))
        h = self.head(x)
        hs = [h]
        for layer in self.downs:
            h = layer(h, temb) if isinstance(layer, ResBlock) else layer(h)
            hs.append(h)
        hs.pop()
        h = self.mid(h, temb)
        for layer in self.ups:
            if isinstance(layer, ResBlock):
                h = layer(torch.cat([h, hs.pop()], dim=1), temb)
            else:
                h = layer(h)
        return self.tail(h)


# ---------------------------- 扩散过程 ----------------------------
class GaussianDiffusion:
    def __init__(self, T, beta_1, beta_T, device):
        self.T = T
        self.betas = torch.linspace(beta_1, beta_T, T, dtype=torch.float64).to(device)
        alphas = 1.0 - self.betas
        self.alphas_bar = torch.cumprod(alphas, dim=0)
        self.sqrt_ab = self.alphas_bar.sqrt().float()
        self.sqrt_1mab = (1 - self.alphas_bar).sqrt().float()

    def q_sample(self, x0, t, noise):
        return self.sqrt_ab[t][:, None, None, None] * x0 + self.sqrt_1mab[t][:, None, None, None] * noise

    @torch.no_grad()
    def sample(self, model, n, device):
        x = torch.randn(n, 3, 32, 32, device=device)
        for i in reversed(range(self.T)):
            t = torch.full((n,), i, device=device, dtype=torch.long)
            eps = model(x, t)
            beta, ab = self.betas[i].float(), self.alphas_bar[i].float()
            mean = (x - beta / (1 - ab).sqrt() * eps) / (1 - beta).sqrt()
            x = mean + beta.sqrt() * torch.randn_like(x) if i > 0 else mean
        return x.clamp(-1, 1)


def ema_update(ema, model, decay):
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


def infinite_loader(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for x, _ in loader:
            yield x
        epoch += 1


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)

    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        writer = SummaryWriter(args.out)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    # 只让 rank0 下载数据, 其他进程等待
    if rank == 0:
        datasets.CIFAR10(args.data, train=True, download=True)
    dist.barrier()
    dataset = datasets.CIFAR10(args.data, train=True, download=False, transform=tf)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=CFG.batch_size, sampler=sampler, num_workers=4,
                        drop_last=True, pin_memory=True)

    net = UNet(CFG.ch, CFG.ch_mult, CFG.dropout).to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    model = DDP(net, device_ids=[args.local_rank])
    diffusion = GaussianDiffusion(CFG.T, CFG.beta_1, CFG.beta_T, device)
    optim = torch.optim.Adam(model.parameters(), lr=CFG.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(s, CFG.warmup) / CFG.warmup)

    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["net"])
        ema.load_state_dict(ckpt["ema"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        step = ckpt["step"]

    data_iter = infinite_loader(loader, sampler)
    t0 = time.time()
    while step < CFG.total_steps:
        x0 = next(data_iter).to(device, non_blocking=True)
        t = torch.randint(0, CFG.T, (x0.shape[0],), device=device)
        noise = torch.randn_like(x0)
        xt = diffusion.q_sample(x0, t, noise)
        loss = F.mse_loss(model(xt, t), noise)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.grad_clip)
        optim.step()
        sched.step()
        ema_update(ema, model.module, CFG.ema_decay)
        step += 1

        if step % CFG.log_every == 0:
            l = loss.detach().clone()
            dist.all_reduce(l)
            l = l.item() / world_size
            if rank == 0:
                print(f"step {step} loss {l:.5f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / CFG.log_every:.3f}s/it")
                writer.add_scalar("train/loss", l, step)
            t0 = time.time()
        if rank == 0 and step % CFG.sample_every == 0:
            imgs = diffusion.sample(ema, 64, device)
            save_image((imgs + 1) / 2, os.path.join(args.out, "samples", f"{step:07d}.png"), nrow=8)
        if rank == 0 and step % CFG.save_every == 0:
            torch.save({"net": model.module.state_dict(), "ema": ema.state_dict(),
                        "optim": optim.state_dict(), "sched": sched.state_dict(), "step": step},
                       os.path.join(args.out, "ckpt.pt"))
        if step % CFG.sample_every == 0:
            dist.barrier()  # 等 rank0 采样完再继续

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
