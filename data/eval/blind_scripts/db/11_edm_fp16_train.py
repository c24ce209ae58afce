"""EDM (Karras et al. 2022) preconditioned training on FFHQ-64 with fp16 autocast + GradScaler.

torchrun --standalone --nproc_per_node=8 11_edm_fp16_train.py --data /data/ffhq-64x64 --outdir runs/edm-ffhq64
"""
import argparse
import json
import math
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from diffusers import UNet2DModel
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ImageFolderFlat(Dataset):
    def __init__(self, root, xflip=True):
        self.paths = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".png"))
        self.xflip = xflip

    def __len__(self):
        return len(self.paths) * (2 if self.xflip else 1)

    def __getitem__(self, idx):
        img = np.asarray(Image.open(self.paths[idx % len(self.paths)]).convert("RGB"), dtype=np.uint8)
        if idx >= len(self.paths):
            img = img[:, ::-1]
        return torch.from_numpy(img.copy()).permute(2, 0, 1)


class EDMPrecond(nn.Module):
    def __init__(self, res, sigma_data=0.5):
        super().__init__()
        self.sigma_data = sigma_data
        self.net = UNet2DModel(
            sample_size=res, in_channels=3, out_channels=3, layers_per_block=4,
            block_out_channels=(128, 256, 256, 256),
            down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
            time_embedding_type="positional", flip_sin_to_cos=False, freq_shift=1,
        )

    def forward(self, x, sigma):
        sigma = sigma.view(-1, 1, 1, 1)
        c_skip = self.sigma_data ** 2 / (sigma ** 2 + self.sigma_data ** 2)
        c_out = sigma * self.sigma_data / (sigma ** 2 + self.sigma_data ** 2).sqrt()
        c_in = 1 / (self.sigma_data ** 2 + sigma ** 2).sqrt()
        c_noise = sigma.log().flatten() / 4
        F_x = self.net(c_in * x, c_noise).sample
        return c_skip * x + c_out * F_x.float()


class EDMLoss:
    def __init__(self, P_mean=-1.2, P_std=1.2, sigma_data=0.5):
        self.P_mean, self.P_std, self.sigma_data = P_mean, P_std, sigma_data

    def __call__(self, net, images):
        rnd = torch.randn(images.shape[0], device=images.device)
        sigma = (rnd * self.P_std + self.P_mean).exp()
        weight = (sigma ** 2 + self.sigma_data ** 2) / (sigma * self.sigma_data) ** 2
        n = torch.randn_like(images) * sigma.view(-1, 1, 1, 1)
        D = net(images + n, sigma)
        return (weight.view(-1, 1, 1, 1) * (D - images) ** 2).mean()


@torch.no_grad()
def edm_sampler(net, latents, num_steps=18, sigma_min=0.002, sigma_max=80, rho=7):
    i = torch.arange(num_steps, dtype=torch.float64, device=latents.device)
    t = (sigma_max ** (1 / rho) + i / (num_steps - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    t = torch.cat([t, torch.zeros_like(t[:1])])
    x = latents.double() * t[0]
    for k in range(num_steps):
        tc, tn = t[k], t[k + 1]
        d = (x - net(x.float(), tc.float().repeat(len(x))).double()) / tc
        xn = x + (tn - tc) * d
        if k < num_steps - 1:
            d2 = (xn - net(xn.float(), tn.float().repeat(len(x))).double()) / tn
            xn = x + (tn - tc) * (0.5 * d + 0.5 * d2)
        x = xn
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--batch", type=int, default=512, help="total batch size")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lr_rampup_kimg", type=float, default=10_000)
    ap.add_argument("--ema_halflife_kimg", type=float, default=500)
    ap.add_argument("--duration_mimg", type=float, default=200)
    ap.add_argument("--snapshot_ticks", type=int, default=50)
    ap.add_argument("--kimg_per_tick", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    np.random.seed((args.seed * world + rank) % (1 << 31))
    torch.manual_seed(np.random.randint(1 << 31))
    torch.backends.cudnn.benchmark = True

    batch_gpu = args.batch // world
    dataset = ImageFolderFlat(args.data)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=batch_gpu, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, prefetch_factor=4)

    net = EDMPrecond(res=64).to(device)
    ema = deepcopy(net).eval().requires_grad_(False)
    ddp = DDP(net, device_ids=[device], broadcast_buffers=False)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    scaler = torch.cuda.amp.GradScaler(init_scale=2 ** 14)
    loss_fn = EDMLoss()

    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)
        with open(os.path.join(args.outdir, "training_options.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    cur_nimg, cur_tick, epoch = 0, 0, 0
    tick_start_nimg, tick_start = 0, time.time()
    total_nimg = int(args.duration_mimg * 1e6)
    skipped = 0
    while cur_nimg < total_nimg:
        sampler.set_epoch(epoch)
        for images in loader:
            images = images.to(device, non_blocking=True).float() / 127.5 - 1
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(ddp, images)
            if not torch.isfinite(loss):
                skipped += 1
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()

            lr = args.lr * min(cur_nimg / max(args.lr_rampup_kimg * 1000, 1e-8), 1)
            for g in opt.param_groups:
                g["lr"] = lr
            scaler.unscale_(opt)
            for p in net.parameters():
                if p.grad is not None:
                    torch.nan_to_num(p.grad, nan=0, posinf=1e5, neginf=-1e5, out=p.grad)
            scaler.step(opt)
            scaler.update()

            cur_nimg += args.batch
            beta = 0.5 ** (args.batch / max(args.ema_halflife_kimg * 1000, 1e-8))
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.copy_(p.detach().lerp(pe, beta))

            if cur_nimg >= tick_start_nimg + args.kimg_per_tick * 1000 or cur_nimg >= total_nimg:
                stats = torch.tensor([loss.item(), float(skipped)], device=device)
                dist.all_reduce(stats)
                if rank == 0:
                    sec = time.time() - tick_start
                    print(f"tick {cur_tick:5d} kimg {cur_nimg / 1e3:9.1f} loss {stats[0].item() / world:.4f} "
                          f"sec/kimg {sec / ((cur_nimg - tick_start_nimg) / 1e3):.3f} skipped {int(stats[1])} "
                          f"scale {scaler.get_scale():.0f}", flush=True)
                    if cur_tick % args.snapshot_ticks == 0:
                        torch.save({"ema": ema.state_dict(), "net": net.state_dict(), "opt": opt.state_dict(),
                                    "scaler": scaler.state_dict(), "cur_nimg": cur_nimg},
                                   os.path.join(args.outdir, f"network-snapshot-{cur_nimg // 1000:06d}.pt"))
                        g = torch.Generator(device=device).manual_seed(0)
                        x = edm_sampler(ema, torch.randn(64, 3, 64, 64, device=device, generator=g))
                        img = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
                        img = img.reshape(8, 8, 3, 64, 64).transpose(0, 3, 1, 4, 2).reshape(512, 512, 3)
                        Image.fromarray(img).save(os.path.join(args.outdir, f"fakes{cur_nimg // 1000:06d}.png"))
                dist.barrier()
                cur_tick += 1
                tick_start_nimg, tick_start = cur_nimg, time.time()
            if cur_nimg >= total_nimg:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
