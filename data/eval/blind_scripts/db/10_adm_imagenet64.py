"""
Class-conditional pixel DDPM on ImageNet-64 (ADM-style UNet, v-prediction, bf16 autocast).
Supports resuming long runs from a checkpoint.

    torchrun --nproc_per_node=8 10_adm_imagenet64.py --data /datasets/imagenet64 --out /shared/exp/in64
    torchrun --nproc_per_node=8 10_adm_imagenet64.py --data /datasets/imagenet64 --out /shared/exp/in64 \
        --resume /shared/exp/in64/ckpt_0200000.pt
"""
import argparse
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms


@dataclass
class Config:
    data: str = ""
    out: str = "exp"
    resume: str = ""
    num_classes: int = 1000
    base_ch: int = 192
    global_batch: int = 2048
    lr: float = 3e-4
    warmup: int = 10_000
    total_steps: int = 540_000
    ema_decay: float = 0.9999
    p_uncond: float = 0.1
    save_every: int = 20_000
    log_every: int = 200
    workers: int = 8
    seed: int = 0


def sinusoidal(t, dim):
    half = dim // 2
    f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    a = t[:, None].float() * f[None]
    return torch.cat([a.sin(), a.cos()], 1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, emb, down=False, up=False):
        super().__init__()
        self.in_layers = nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU())
        self.resample = nn.AvgPool2d(2) if down else (nn.Upsample(scale_factor=2) if up else nn.Identity())
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb, 2 * cout)
        self.norm2 = nn.GroupNorm(32, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, e):
        h = self.conv1(self.resample(self.in_layers(x)))
        x = self.resample(x)
        scale, shift = self.emb(F.silu(e))[:, :, None, None].chunk(2, 1)
        h = self.norm2(h) * (1 + scale) + shift
        return self.skip(x) + self.conv2(F.silu(h))


class UNet(nn.Module):
    def __init__(self, ch=192, mults=(1, 2, 3, 4), num_classes=1000):
        super().__init__()
        emb = ch * 4
        self.ch, self.num_classes = ch, num_classes
        self.t_mlp = nn.Sequential(nn.Linear(ch, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.y_emb = nn.Embedding(num_classes + 1, emb)  # last index = unconditional
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.downs, skips, c = nn.ModuleList(), [ch], ch
        for i, m in enumerate(mults):
            for _ in range(2):
                self.downs.append(ResBlock(c, ch * m, emb))
                c = ch * m
                skips.append(c)
            if i < len(mults) - 1:
                self.downs.append(ResBlock(c, c, emb, down=True))
                skips.append(c)
        self.mid = nn.ModuleList([ResBlock(c, c, emb), ResBlock(c, c, emb)])
        self.ups = nn.ModuleList()
        for i, m in reversed(list(enumerate(mults))):
            for j in range(3):
                self.ups.append(ResBlock(c + skips.pop(), ch * m, emb))
                c = ch * m
            if i > 0:
                self.ups.append(ResBlock(c, c, emb, up=True))
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x, t, y):
        e = self.t_mlp(sinusoidal(t * 1000, self.ch)) + self.y_emb(y)
        h = self.inp(x)
        hs = [h]
        for blk in self.downs:
            h = blk(h, e)
            hs.append(h)
        for blk in self.mid:
            h = blk(h, e)
        for blk in self.ups:
            h = blk(torch.cat([h, hs.pop()], 1) if not isinstance(blk.resample, nn.Upsample) else h, e)
        return self.out(h)


def alpha_sigma(t):
    # cosine schedule in continuous time
    return torch.cos(t * math.pi / 2), torch.sin(t * math.pi / 2)


def main(cfg: Config):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + 1000 * rank)

    net = UNet(cfg.base_ch, num_classes=cfg.num_classes).to(device)
    ema = UNet(cfg.base_ch, num_classes=cfg.num_classes).to(device).requires_grad_(False)
    ema.load_state_dict(net.state_dict())
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)

    step = 0
    if cfg.resume:
        ckpt = torch.load(cfg.resume)
        net.load_state_dict(ckpt["net"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        step = ckpt["step"]
        del ckpt
        if rank == 0:
            print(f"resumed from {cfg.resume} at step {step}", flush=True)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(os.path.join(cfg.data, "train"), transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed)
    dl = DataLoader(ds, batch_size=cfg.global_batch // world, sampler=sampler, num_workers=cfg.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    epoch = step // len(dl)
    t0 = time.time()
    while step < cfg.total_steps:
        sampler.set_epoch(epoch)
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            y = torch.where(torch.rand(y.shape, device=device) < cfg.p_uncond, torch.full_like(y, cfg.num_classes), y)
            t = torch.rand(x.shape[0], device=device)
            a, s = (v.view(-1, 1, 1, 1) for v in alpha_sigma(t))
            noise = torch.randn_like(x)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v_pred = model(a * x + s * noise, t, y)
            loss = F.mse_loss(v_pred.float(), a * noise - s * x)

            lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(net.parameters()), 1 - cfg.ema_decay)
            step += 1

            if step % cfg.log_every == 0:
                stats = torch.stack([loss.detach(), torch.tensor(float(x.shape[0]), device=device)])
                dist.all_reduce(stats)
                if rank == 0:
                    ips = stats[1].item() * cfg.log_every / (time.time() - t0)
                    print(f"step {step:7d} loss {stats[0].item() / world:.4f} lr {lr:.2e} img/s {ips:.0f}", flush=True)
                t0 = time.time()

            if step % cfg.save_every == 0:
                if rank == 0:
                    torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "step": step, "cfg": asdict(cfg)}, os.path.join(cfg.out, f"ckpt_{step:07d}.pt"))
                dist.barrier()
            if step >= cfg.total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    main(Config(**vars(p.parse_args())))
