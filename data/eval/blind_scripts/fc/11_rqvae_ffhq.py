"""RQ-VAE (residual quantization, depth 4, shared codebook) for 256x256 images, 8x8x4 codes.

The cluster preempts jobs every few hours, so the script auto-resumes from the newest <run>/ckpt/step_*.pt.

    torchrun --nproc_per_node=8 11_rqvae_ffhq.py --run /nfs/gen/runs/rqvae_ffhq --data /nfs/datasets/ffhq
"""
import argparse
import glob
import os
import time

import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from lab_models.rq import RQDecoder, RQEncoder


class ResidualQuantizer(nn.Module):
    def __init__(self, n_codes, dim, depth, decay=0.99):
        super().__init__()
        self.depth, self.decay, self.n_codes = depth, decay, n_codes
        self.register_buffer("codebook", torch.randn(n_codes, dim) * 0.02)
        self.register_buffer("ema_count", torch.ones(n_codes))
        self.register_buffer("ema_sum", self.codebook.clone())

    def nearest(self, r):
        d = r.pow(2).sum(1, keepdim=True) - 2 * r @ self.codebook.t() + self.codebook.pow(2).sum(1)
        return d.argmin(1)

    def forward(self, z):
        b, c, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, c)
        resid = flat
        agg = torch.zeros_like(flat)
        codes, commit = [], 0.0
        cnt = torch.zeros(self.n_codes, device=z.device)
        s = torch.zeros_like(self.codebook)
        for _ in range(self.depth):
            idx = self.nearest(resid.detach())
            q = self.codebook[idx]
            agg = agg + q
            commit = commit + F.mse_loss(flat, agg.detach())
            if self.training:
                cnt.index_add_(0, idx, torch.ones_like(idx, dtype=cnt.dtype))
                s.index_add_(0, idx, resid.detach())
            resid = resid - q
            codes.append(idx.view(b, h, w))
        if self.training:
            dist.all_reduce(cnt)
            dist.all_reduce(s)
            self.ema_count.mul_(self.decay).add_(cnt, alpha=1 - self.decay)
            self.ema_sum.mul_(self.decay).add_(s, alpha=1 - self.decay)
            self.codebook.copy_(self.ema_sum / self.ema_count.clamp_min(1e-5)[:, None])
        zq = flat + (agg - flat).detach()
        return zq.view(b, h, w, c).permute(0, 3, 1, 2), commit / self.depth, torch.stack(codes, -1)


class RQVAE(nn.Module):
    def __init__(self, n_codes=16384, dim=256, depth=4):
        super().__init__()
        self.enc = RQEncoder(ch=128, ch_mult=(1, 1, 2, 2, 4), z_channels=dim)
        self.rq = ResidualQuantizer(n_codes, dim, depth)
        self.dec = RQDecoder(ch=128, ch_mult=(1, 1, 2, 2, 4), z_channels=dim)

    def forward(self, x):
        zq, commit, codes = self.rq(self.enc(x))
        return self.dec(zq), commit, codes


def latest_checkpoint(run):
    files = sorted(glob.glob(os.path.join(run, "ckpt", "step_*.pt")))
    return files[-1] if files else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--total_steps", type=int, default=400_000)
    ap.add_argument("--ckpt_every", type=int, default=5000)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--beta", type=float, default=0.25)
    ap.add_argument("--lpips_w", type=float, default=1.0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tf = transforms.Compose([transforms.Resize(256), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    ds = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    model = RQVAE().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.9))
    perceptual = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)

    step = 0
    resume = latest_checkpoint(args.run)
    if resume is not None:
        ckpt = torch.load(resume)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resuming from {resume} (step {step})", flush=True)
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)

    if rank == 0:
        os.makedirs(os.path.join(args.run, "ckpt"), exist_ok=True)
    epoch = step // len(dl)
    t0 = time.time()
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for x, _ in dl:
            x = x.to(device, non_blocking=True)
            xr, commit, codes = model(x)
            rec = F.l1_loss(xr, x) + args.lpips_w * perceptual(xr, x).mean()
            loss = rec + args.beta * commit
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if step % 100 == 0:
                m = torch.stack([rec.detach(), commit.detach()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    used = model.module.rq.ema_count.gt(1e-3).sum().item()
                    print(f"step {step} rec {m[0]:.4f} commit {m[1]:.5f} live codes {used} "
                          f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                    t0 = time.time()

            if step % args.ckpt_every == 0:
                if rank == 0:
                    path = os.path.join(args.run, "ckpt", f"step_{step:08d}.pt")
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".part")
                    os.replace(path + ".part", path)
                    for old in sorted(glob.glob(os.path.join(args.run, "ckpt", "step_*.pt")))[:-args.keep]:
                        os.remove(old)
                dist.barrier()
            if step >= args.total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
