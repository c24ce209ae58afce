"""3D VQGAN video tokenizer with FSQ (finite scalar quantisation), LPIPS and a 3D PatchGAN discriminator.

    torchrun --nproc_per_node=8 12_fsq_vqgan_video.py --train /data/k700/train.csv --test /data/ucf101/test.csv
"""
import argparse
import csv
import os
import random

import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.io as tvio
from pytorch_msssim import ssim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def read_csv(path):
    with open(path) as f:
        return [row["path"] for row in csv.DictReader(f)]


class VideoClips(Dataset):
    def __init__(self, paths, frames=16, size=128):
        self.paths, self.frames, self.size = paths, frames, size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        v, _, _ = tvio.read_video(self.paths[i], pts_unit="sec", output_format="TCHW")
        if v.shape[0] < self.frames:
            v = torch.cat([v, v[-1:].repeat(self.frames - v.shape[0], 1, 1, 1)])
        s = random.randint(0, v.shape[0] - self.frames)
        v = v[s:s + self.frames].float() / 127.5 - 1
        h, w = v.shape[-2:]
        m = min(h, w)
        y, x = random.randint(0, h - m), random.randint(0, w - m)
        v = F.interpolate(v[:, :, y:y + m, x:x + m], size=self.size, mode="bilinear", antialias=True, align_corners=False)
        return v.transpose(0, 1)  # C T H W


class FSQ(nn.Module):
    def __init__(self, levels=(8, 8, 8, 5, 5, 5)):
        super().__init__()
        self.register_buffer("levels", torch.tensor(levels, dtype=torch.float32), persistent=False)

    def forward(self, z):  # z: B C T H W with C == len(levels)
        l = self.levels.view(1, -1, 1, 1, 1)
        half = (l - 1) / 2
        offset = torch.where(l % 2 == 0, 0.5, 0.0)
        shift = torch.atanh(offset / half)
        bounded = torch.tanh(z + shift) * half - offset
        q = bounded + (torch.round(bounded) - bounded).detach()
        return q / half.floor().clamp_min(1)


def res3d(c):
    return nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv3d(c, c, 3, 1, 1), nn.GroupNorm(32, c), nn.SiLU(),
                         nn.Conv3d(c, c, 3, 1, 1))


class Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.f = res3d(c)

    def forward(self, x):
        return x + self.f(x)


class VQGAN3D(nn.Module):
    def __init__(self, ch=96, zc=6):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv3d(3, ch, 3, 1, 1), Res(ch),
            nn.Conv3d(ch, ch * 2, 4, 2, 1), Res(ch * 2),
            nn.Conv3d(ch * 2, ch * 4, (3, 4, 4), (1, 2, 2), 1), Res(ch * 4),
            nn.Conv3d(ch * 4, ch * 4, 4, 2, 1), Res(ch * 4), Res(ch * 4),
            nn.GroupNorm(32, ch * 4), nn.SiLU(), nn.Conv3d(ch * 4, zc, 1))
        self.quant = FSQ()
        self.decoder = nn.Sequential(
            nn.Conv3d(zc, ch * 4, 3, 1, 1), Res(ch * 4), Res(ch * 4),
            nn.ConvTranspose3d(ch * 4, ch * 4, 4, 2, 1), Res(ch * 4),
            nn.ConvTranspose3d(ch * 4, ch * 2, (3, 4, 4), (1, 2, 2), 1), Res(ch * 2),
            nn.ConvTranspose3d(ch * 2, ch, 4, 2, 1), Res(ch),
            nn.GroupNorm(32, ch), nn.SiLU())
        self.conv_out = nn.Conv3d(ch, 3, 3, 1, 1)

    def encode(self, x):
        return self.quant(self.encoder(x))

    def decode(self, z):
        return self.conv_out(self.decoder(z))

    def get_last_layer(self):
        return self.conv_out.weight

    def forward(self, x):
        return self.decode(self.encode(x))


class PatchDisc3D(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv3d(3, ch, 4, 2, 1), nn.LeakyReLU(0.2, True),
            nn.Conv3d(ch, ch * 2, 4, 2, 1), nn.GroupNorm(32, ch * 2), nn.LeakyReLU(0.2, True),
            nn.Conv3d(ch * 2, ch * 4, 4, 2, 1), nn.GroupNorm(32, ch * 4), nn.LeakyReLU(0.2, True),
            nn.Conv3d(ch * 4, 1, 3, 1, 1))

    def forward(self, x):
        return self.net(x)


def adaptive_weight(nll, g_loss, last_layer, max_w=1e4):
    nll_grad = torch.autograd.grad(nll, last_layer, retain_graph=True)[0]
    g_grad = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    return (nll_grad.norm() / (g_grad.norm() + 1e-4)).clamp(0, max_w).detach()


@torch.no_grad()
def eval_videos(net, lp, paths, device, rank, world, clip_len=16, size=128):
    net.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for p in paths[rank::world]:
        v, _, _ = tvio.read_video(p, pts_unit="sec", output_format="TCHW")
        n = v.shape[0] // clip_len * clip_len
        if n == 0:
            continue
        v = v[:n].float().to(device) / 127.5 - 1
        h, w = v.shape[-2:]
        m = min(h, w)
        v = F.interpolate(v[:, :, (h - m) // 2:(h - m) // 2 + m, (w - m) // 2:(w - m) // 2 + m], size=size,
                          mode="bilinear", antialias=True, align_corners=False)
        clips = v.view(n // clip_len, clip_len, 3, size, size).transpose(1, 2)
        rec = torch.cat([net(c.unsqueeze(0)) for c in clips]).clamp(-1, 1)
        fr, fg = rec.transpose(1, 2).flatten(0, 1), clips.transpose(1, 2).flatten(0, 1)
        mse = ((fr - fg) / 2).pow(2).mean((1, 2, 3))
        acc[0] += (-10 * torch.log10(mse)).sum()
        acc[1] += ssim((fr + 1) / 2, (fg + 1) / 2, data_range=1.0, size_average=False).sum()
        acc[2] += lp(fr, fg).sum()
        acc[3] += fr.shape[0]
    dist.all_reduce(acc)
    net.train()
    return (acc[:3] / acc[3].clamp_min(1)).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", default="runs/fsq_vqgan")
    ap.add_argument("--bs", type=int, default=2, help="clips per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=400000)
    ap.add_argument("--disc_start", type=int, default=50000)
    ap.add_argument("--disc_w", type=float, default=0.1)
    ap.add_argument("--lpips_w", type=float, default=1.0)
    ap.add_argument("--eval_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = DDP(VQGAN3D().to(device), device_ids=[local_rank])
    disc = DDP(PatchDisc3D().to(device), device_ids=[local_rank])
    lp = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)
    opt_g = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=args.lr, betas=(0.5, 0.9))
    step = 0
    ck_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        disc.module.load_state_dict(ck["disc"])
        opt_g.load_state_dict(ck["opt_g"])
        opt_d.load_state_dict(ck["opt_d"])
        step = ck["step"]

    train_set = VideoClips(read_csv(args.train))
    test_paths = read_csv(args.test)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=10, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    epoch = step // len(loader)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x in loader:
            x = x.to(device, non_blocking=True)
            use_gan = step >= args.disc_start

            # generator / autoencoder
            rec = model(x)
            fr, fg = rec.transpose(1, 2).flatten(0, 1), x.transpose(1, 2).flatten(0, 1)
            nll = (rec - x).abs().mean() + args.lpips_w * lp(fr, fg).mean()
            if use_gan:
                g_loss = -disc.module(rec).mean()
                w = adaptive_weight(nll, g_loss, model.get_last_layer())
                loss_g = nll + args.disc_w * w * g_loss
            else:
                loss_g = nll
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()

            # discriminator (hinge)
            if use_gan:
                logits = disc(torch.cat([x, rec.detach()]))
                logits_real, logits_fake = logits.chunk(2)
                d_loss = 0.5 * (F.relu(1 - logits_real).mean() + F.relu(1 + logits_fake).mean())
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                msg = f"step {step} nll {nll.item():.4f}"
                if use_gan:
                    msg += f" g {g_loss.item():.4f} d {d_loss.item():.4f} w {w.item():.3f}"
                print(msg, flush=True)
            if step % args.eval_every == 0:
                psnr, ss, lpv = eval_videos(model.module, lp, test_paths, device, rank, world)
                if rank == 0:
                    print(f"step {step} test PSNR {psnr:.2f} SSIM {ss:.4f} LPIPS {lpv:.4f}", flush=True)
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "disc": disc.module.state_dict(),
                                "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(), "step": step},
                               ck_path)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
