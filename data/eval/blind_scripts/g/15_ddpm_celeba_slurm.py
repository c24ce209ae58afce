"""DDPM on CelebA 64x64 - from the diffusion tutorial, scaled out on the cluster.

    #SBATCH -N 2 --ntasks-per-node=8 --gres=gpu:8 --cpus-per-task=6
    srun python 15_ddpm_celeba_slurm.py --data /data/celeba64 --out /ckpt/ddpm_celeba

Preemptible partition -> we checkpoint every `--ckpt_every` steps and auto-resume.
"""
import argparse
import copy
import math
import os
import subprocess

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms, utils


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/celeba64")
    p.add_argument("--out", default="/ckpt/ddpm_celeba")
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--steps", type=int, default=300_000)
    p.add_argument("--T", type=int, default=1000)
    p.add_argument("--ckpt_every", type=int, default=5000)
    p.add_argument("--sample_every", type=int, default=10000)
    p.add_argument("--ema", type=float, default=0.9999)
    p.add_argument("--port", type=int, default=29400)
    return p.parse_args()


def init_distributed(port):
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    host = subprocess.check_output(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).decode().split()[0]
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world)
    return rank, world, local_rank


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.t(temb)[:, :, None, None]
        h = self.c2(F.dropout(F.silu(self.n2(h)), 0.1, self.training))
        return h + self.skip(x)


class UNet(nn.Module):
    def __init__(self, ch=128, mults=(1, 2, 2, 2)):
        super().__init__()
        self.tdim = ch * 4
        self.temb = nn.Sequential(nn.Linear(ch, self.tdim), nn.SiLU(), nn.Linear(self.tdim, self.tdim))
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        chans, c = [ch], ch
        for i, m in enumerate(mults):
            self.down.append(ResBlock(c, ch * m, self.tdim))
            c = ch * m
            chans.append(c)
        self.mid = ResBlock(c, c, self.tdim)
        for i, m in reversed(list(enumerate(mults))):
            self.up.append(ResBlock(c + chans.pop(), ch * m, self.tdim))
            c = ch * m
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))
        self.ch = ch

    def forward(self, x, t):
        temb = self.temb(timestep_embedding(t, self.ch))
        h = self.inp(x)
        hs = [h]
        for i, blk in enumerate(self.down):
            h = blk(h, temb)
            hs.append(h)
            if i < len(self.down) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.mid(h, temb)
        for i, blk in enumerate(self.up):
            skip = hs.pop()
            if skip.shape[-1] != h.shape[-1]:
                h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = blk(torch.cat([h, skip], 1), temb)
        return self.out(h)


def save_ckpt(path, model, ema, opt, step):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(),
                "opt": opt.state_dict(), "step": step}, path)


@torch.no_grad()
def sample(model, n, betas, device):
    alphas = 1 - betas
    abar = torch.cumprod(alphas, 0)
    x = torch.randn(n, 3, 64, 64, device=device)
    for t in reversed(range(len(betas))):
        tt = torch.full((n,), t, device=device, dtype=torch.long)
        eps = model(x, tt)
        x = (x - betas[t] / torch.sqrt(1 - abar[t]) * eps) / torch.sqrt(alphas[t])
        if t > 0:
            x = x + torch.sqrt(betas[t]) * torch.randn_like(x)
    return (x.clamp(-1, 1) + 1) / 2


def main():
    args = get_args()
    rank, world, local_rank = init_distributed(args.port)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    net = UNet().to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    ckpt_path = os.path.join(args.out, "latest.pt")
    step = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
    model = DDP(net, device_ids=[local_rank])

    betas = torch.linspace(1e-4, 0.02, args.T, device=device)
    abar = torch.cumprod(1 - betas, 0)
    epoch = step // len(dl)
    if rank == 0:
        print(f"world={world} start step={step} epoch={epoch}", flush=True)

    while step < args.steps:
        sampler.set_epoch(epoch)
        for x0, _ in dl:
            x0 = x0.to(device, non_blocking=True)
            t = torch.randint(0, args.T, (x0.size(0),), device=device)
            noise = torch.randn_like(x0)
            a = abar[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
            loss = F.mse_loss(model(xt, t), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), net.parameters()):
                    pe.mul_(args.ema).add_(pm.detach(), alpha=1 - args.ema)
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step % args.ckpt_every == 0:
                save_ckpt(ckpt_path, net, ema, opt, step)
            if rank == 0 and step % args.sample_every == 0:
                imgs = sample(ema, 64, betas, device)
                utils.save_image(imgs, os.path.join(args.out, f"samples_{step:07d}.png"), nrow=8)
            if step >= args.steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
