"""Causal 3D VQ-VAE video tokenizer.

Trains on random temporal crops (1 + 4k frames) and reports reconstruction PSNR / SSIM / LPIPS over
whole test videos.

torchrun --nnodes=1 --nproc_per_node=8 04_vq_video_tokenizer.py --train_list lists/k600_train.txt \
    --val_list lists/ucf101_test.txt --out ckpt/vq_k600
"""
import argparse
import math
import os
import random

import decord
import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorch_msssim import ssim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

decord.bridge.set_bridge("torch")


class ClipDataset(Dataset):
    def __init__(self, list_file, num_frames=17, size=128, max_stride=3):
        with open(list_file) as f:
            self.videos = [l.strip() for l in f if l.strip()]
        self.num_frames, self.size, self.max_stride = num_frames, size, max_stride

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        vr = decord.VideoReader(self.videos[i], num_threads=1)
        n = len(vr)
        stride = random.randint(1, self.max_stride)
        while stride > 1 and (self.num_frames - 1) * stride >= n:
            stride -= 1
        span = (self.num_frames - 1) * stride + 1
        start = random.randint(0, max(0, n - span))
        idx = [min(start + k * stride, n - 1) for k in range(self.num_frames)]
        frames = vr.get_batch(idx).permute(3, 0, 1, 2).float() / 127.5 - 1.0  # C T H W
        _, _, h, w = frames.shape
        s = min(h, w)
        y, x = random.randint(0, h - s), random.randint(0, w - s)
        frames = frames[:, :, y:y + s, x:x + s]
        frames = F.interpolate(frames, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=True)
        if random.random() < 0.5:
            frames = frames.flip(-1)
        return frames


def load_full_video(path, size=128):
    vr = decord.VideoReader(path, num_threads=2)
    frames = vr.get_batch(list(range(len(vr)))).permute(3, 0, 1, 2).float() / 127.5 - 1.0
    _, _, h, w = frames.shape
    s = min(h, w)
    frames = frames[:, :, (h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
    return F.interpolate(frames, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


class CausalConv3d(nn.Module):
    def __init__(self, cin, cout, k=3, stride=(1, 1, 1)):
        super().__init__()
        self.pad_t = k - 1
        self.conv = nn.Conv3d(cin, cout, k, stride=stride, padding=(0, k // 2, k // 2))

    def forward(self, x):
        x = F.pad(x, (0, 0, 0, 0, self.pad_t, 0), mode="replicate")
        return self.conv(x)


class ResBlock3d(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), CausalConv3d(cin, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), CausalConv3d(cout, cout)
        self.skip = nn.Conv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.c1(F.silu(self.n1(x)))
        h = self.c2(F.silu(self.n2(h)))
        return self.skip(x) + h


class Upsample3d(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = CausalConv3d(cin, cout)

    def forward(self, x):
        x = x.repeat_interleave(2, dim=2)[:, :, 1:]
        x = F.interpolate(x, scale_factor=(1, 2, 2), mode="nearest")
        return self.conv(x)


class VectorQuantizer(nn.Module):
    def __init__(self, num_codes, dim, beta=0.25):
        super().__init__()
        self.embedding = nn.Embedding(num_codes, dim)
        self.embedding.weight.data.uniform_(-1.0 / num_codes, 1.0 / num_codes)
        self.beta = beta

    def forward(self, z):
        b, c, t, h, w = z.shape
        zf = z.permute(0, 2, 3, 4, 1).reshape(-1, c)
        emb = self.embedding.weight
        d = zf.pow(2).sum(1, keepdim=True) - 2 * zf @ emb.t() + emb.pow(2).sum(1)[None]
        idx = d.argmin(1)
        zq = self.embedding(idx).view(b, t, h, w, c).permute(0, 4, 1, 2, 3)
        loss = self.beta * F.mse_loss(z, zq.detach()) + F.mse_loss(zq, z.detach())
        zq = z + (zq - z).detach()
        usage = torch.bincount(idx, minlength=emb.shape[0]).float()
        return zq, loss, idx.view(b, t, h, w), usage


class VQVideo(nn.Module):
    def __init__(self, ch=64, z_dim=8, num_codes=8192):
        super().__init__()
        self.encoder = nn.Sequential(
            CausalConv3d(3, ch), ResBlock3d(ch, ch),
            CausalConv3d(ch, ch * 2, stride=(2, 2, 2)), ResBlock3d(ch * 2, ch * 2),
            CausalConv3d(ch * 2, ch * 4, stride=(2, 2, 2)), ResBlock3d(ch * 4, ch * 4), ResBlock3d(ch * 4, ch * 4),
            nn.GroupNorm(32, ch * 4), nn.SiLU(), nn.Conv3d(ch * 4, z_dim, 1))
        self.quant = VectorQuantizer(num_codes, z_dim)
        self.decoder = nn.Sequential(
            nn.Conv3d(z_dim, ch * 4, 1), ResBlock3d(ch * 4, ch * 4), ResBlock3d(ch * 4, ch * 4),
            Upsample3d(ch * 4, ch * 2), ResBlock3d(ch * 2, ch * 2),
            Upsample3d(ch * 2, ch), ResBlock3d(ch, ch),
            nn.GroupNorm(32, ch), nn.SiLU(), CausalConv3d(ch, 3))

    def forward(self, x):
        zq, vq_loss, idx, usage = self.quant(self.encoder(x))
        return self.decoder(zq), vq_loss, usage


@torch.no_grad()
def evaluate(net, perceptual, videos, device, rank, world, chunk=17):
    net.eval()
    psnr_sum = ssim_sum = lpips_sum = 0.0
    n_frames = 0
    for path in videos[rank::world]:
        video = load_full_video(path).to(device)
        t = video.shape[1]
        pad = (-(t - 1)) % 4
        if pad:
            video_in = torch.cat([video, video[:, -1:].expand(-1, pad, -1, -1)], 1)
        else:
            video_in = video
        recon = []
        for s in range(0, video_in.shape[1], chunk):
            piece = video_in[:, s:s + chunk]
            if (piece.shape[1] - 1) % 4:
                piece = torch.cat([piece, piece[:, -1:].expand(-1, (-(piece.shape[1] - 1)) % 4, -1, -1)], 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = net(piece.unsqueeze(0))[0]
            recon.append(out[0].float()[:, :min(chunk, video_in.shape[1] - s)])
        recon = torch.cat(recon, 1)[:, :t].clamp(-1, 1)
        gt_f, rc_f = video.transpose(0, 1), recon.transpose(0, 1)  # T C H W
        mse = ((rc_f - gt_f) / 2).pow(2).mean((1, 2, 3))
        psnr_sum += (-10 * torch.log10(mse.clamp_min(1e-10))).sum().item()
        ssim_sum += ssim((rc_f + 1) / 2, (gt_f + 1) / 2, data_range=1.0, size_average=False).sum().item()
        lpips_sum += perceptual(rc_f, gt_f).sum().item()
        n_frames += t
    totals = torch.tensor([psnr_sum, ssim_sum, lpips_sum, float(n_frames)], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    net.train()
    return (totals[:3] / totals[3]).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_list", required=True)
    ap.add_argument("--val_list", required=True)
    ap.add_argument("--out", default="ckpt/vq")
    ap.add_argument("--num_frames", type=int, default=17)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--batch_per_gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max_steps", type=int, default=300000)
    ap.add_argument("--lpips_w", type=float, default=0.1)
    ap.add_argument("--eval_every", type=int, default=5000)
    ap.add_argument("--save_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    model = VQVideo().to(device)
    perceptual = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    step = 0
    last = os.path.join(args.out, "last.pt")
    if os.path.exists(last):
        sd = torch.load(last, map_location="cpu")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        step = sd["step"]
    ddp = DDP(model, device_ids=[local_rank])

    ds = ClipDataset(args.train_list, args.num_frames, args.size)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True, prefetch_factor=4)
    with open(args.val_list) as f:
        val_videos = [l.strip() for l in f if l.strip()]

    epoch = step // len(loader)
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for clip in loader:
            clip = clip.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                recon, vq_loss, usage = ddp(clip)
            recon = recon.float()
            rec_loss = (recon - clip).abs().mean()
            frames_r = recon.transpose(1, 2).flatten(0, 1)
            frames_g = clip.transpose(1, 2).flatten(0, 1)
            p_loss = perceptual(frames_r, frames_g).mean()
            loss = rec_loss + args.lpips_w * p_loss + vq_loss.float()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 100 == 0 and rank == 0:
                used = (usage > 0).sum().item()
                print(f"[{step}] rec {rec_loss.item():.4f} lpips {p_loss.item():.4f} vq {vq_loss.item():.4f} "
                      f"codes used {used}", flush=True)
            if step % args.eval_every == 0:
                psnr, ss, lp = evaluate(model, perceptual, val_videos, device, rank, world)
                if rank == 0:
                    print(f"[{step}] eval PSNR {psnr:.2f} SSIM {ss:.4f} LPIPS {lp:.4f}", flush=True)
            if step % args.save_every == 0:
                if rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, last + ".tmp")
                    os.replace(last + ".tmp", last)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
