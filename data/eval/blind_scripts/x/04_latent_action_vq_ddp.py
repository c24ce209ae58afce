# Latent action model (LAPA / Genie style): a VQ bottleneck between consecutive frames,
# trained on unlabeled manipulation videos stored as HDF5 episodes.
#
#   torchrun --standalone --nproc_per_node=4 train_lam.py --data /datasets/oxe_frames_h5 --out runs/lam
import argparse
import glob
import math
import os
import random

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import wandb


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/lam")
    ap.add_argument("--res", type=int, default=128)
    ap.add_argument("--frame_skip", type=int, default=3)
    ap.add_argument("--codebook", type=int, default=16)
    ap.add_argument("--code_dim", type=int, default=32)
    ap.add_argument("--n_codes_per_step", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--bs", type=int, default=32, help="per-GPU batch size")
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--beta", type=float, default=0.25)
    ap.add_argument("--save_every", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class FramePairs(Dataset):
    """Indexes (episode, t) pairs across all HDF5 files; reads lazily in the worker."""

    def __init__(self, root, res, skip):
        self.files = sorted(glob.glob(os.path.join(root, "*.h5")))
        self.res, self.skip = res, skip
        self.index = []
        for fi, f in enumerate(self.files):
            with h5py.File(f, "r") as h:
                for ep in h.keys():
                    n = h[ep]["rgb"].shape[0]
                    self.index.extend((fi, ep, t) for t in range(0, n - skip))
        self._handles = {}

    def __len__(self):
        return len(self.index)

    def _h(self, fi):
        if fi not in self._handles:
            self._handles[fi] = h5py.File(self.files[fi], "r")
        return self._handles[fi]

    def __getitem__(self, i):
        fi, ep, t = self.index[i]
        rgb = self._h(fi)[ep]["rgb"]
        pair = np.stack([rgb[t], rgb[t + self.skip]])  # [2, H, W, 3] uint8
        x = torch.from_numpy(pair).permute(0, 3, 1, 2).float() / 127.5 - 1
        return F.interpolate(x, size=(self.res, self.res), mode="bilinear", antialias=True, align_corners=False)


class PatchEmbed(nn.Module):
    def __init__(self, res, patch, in_ch, dim):
        super().__init__()
        self.proj = nn.Conv2d(in_ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (res // patch) ** 2, dim) * 0.02)

    def forward(self, x):
        return rearrange(self.proj(x), "b d h w -> b (h w) d") + self.pos


class VectorQuantizer(nn.Module):
    def __init__(self, n, dim, beta):
        super().__init__()
        self.codebook = nn.Embedding(n, dim)
        nn.init.uniform_(self.codebook.weight, -1 / n, 1 / n)
        self.beta = beta

    def forward(self, z):
        z_flat = z.reshape(-1, z.shape[-1])
        d = (z_flat.pow(2).sum(1, keepdim=True) - 2 * z_flat @ self.codebook.weight.t()
             + self.codebook.weight.pow(2).sum(1)[None])
        idx = d.argmin(1)
        zq = self.codebook(idx).view_as(z)
        loss = F.mse_loss(zq, z.detach()) + self.beta * F.mse_loss(z, zq.detach())
        zq = z + (zq - z).detach()
        return zq, loss, idx.view(z.shape[:-1])


class LatentActionModel(nn.Module):
    def __init__(self, a):
        super().__init__()
        p = 8
        self.p, self.res = p, a.res
        self.enc_embed = PatchEmbed(a.res, p, 6, a.width)
        self.action_tokens = nn.Parameter(torch.randn(1, a.n_codes_per_step, a.width) * 0.02)
        enc_layer = nn.TransformerEncoderLayer(a.width, 8, 4 * a.width, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, a.depth)
        self.to_code = nn.Linear(a.width, a.code_dim)
        self.vq = VectorQuantizer(a.codebook, a.code_dim, a.beta)
        self.from_code = nn.Linear(a.code_dim, a.width)
        self.dec_embed = PatchEmbed(a.res, p, 3, a.width)
        dec_layer = nn.TransformerEncoderLayer(a.width, 8, 4 * a.width, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerEncoder(dec_layer, a.depth)
        self.to_pix = nn.Linear(a.width, p * p * 3)

    def forward(self, pair):
        x0, x1 = pair[:, 0], pair[:, 1]
        h = self.enc_embed(torch.cat([x0, x1], dim=1))
        h = torch.cat([self.action_tokens.expand(h.shape[0], -1, -1), h], dim=1)
        h = self.encoder(h)[:, : self.action_tokens.shape[1]]
        zq, vq_loss, codes = self.vq(self.to_code(h))
        d = torch.cat([self.from_code(zq), self.dec_embed(x0)], dim=1)
        d = self.decoder(d)[:, zq.shape[1]:]
        g = self.res // self.p
        pred = rearrange(self.to_pix(d), "b (h w) (p q c) -> b c (h p) (w q)", h=g, w=g, p=self.p, q=self.p)
        return pred, vq_loss, codes


def main():
    a = parse()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234 + rank)
    random.seed(1234 + rank)

    wandb.init(project="latent-action-model", name=os.path.basename(a.out), config=vars(a))

    ds = FramePairs(a.data, a.res, a.frame_skip)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=a.bs, sampler=sampler, num_workers=a.workers, pin_memory=True,
                    drop_last=True, persistent_workers=True, prefetch_factor=4)

    model = LatentActionModel(a).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.05)
    total = a.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 2000) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, step = 0, 0
    if a.resume:
        sd = torch.load(a.resume, map_location=device)
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        scaler.load_state_dict(sd["scaler"])
        start_epoch, step = sd["epoch"] + 1, sd["step"]

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"{len(ds)} frame pairs, {len(dl)} iters/epoch/rank, world={world}")

    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        code_hist = torch.zeros(a.codebook, device=device)
        for pair in dl:
            pair = pair.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                pred, vq_loss, codes = model(pair)
                rec = F.mse_loss(pred.float(), pair[:, 1])
                loss = rec + vq_loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            code_hist += torch.bincount(codes.flatten(), minlength=a.codebook).float()

            if step % 50 == 0:
                stats = torch.stack([rec.detach(), vq_loss.detach().float(), gn.float()])
                dist.all_reduce(stats)
                stats /= world
                wandb.log({"loss/rec": stats[0].item(), "loss/vq": stats[1].item(), "grad_norm": stats[2].item(),
                           "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        dist.all_reduce(code_hist)
        probs = code_hist / code_hist.sum()
        perplexity = torch.exp(-(probs * torch.log(probs + 1e-10)).sum()).item()
        used = int((code_hist > 0).sum())
        wandb.log({"codebook/perplexity": perplexity, "codebook/used": used}, step=step)

        if rank == 0:
            with torch.no_grad():
                m = model.module.eval()
                pred, _, _ = m(pair[:4])
                grid = torch.cat([pair[:4, 0], pair[:4, 1], pred.float().clamp(-1, 1)], dim=-1)
                grid = ((grid + 1) * 127.5).byte().permute(0, 2, 3, 1).cpu().numpy()
                wandb.log({"recon": [wandb.Image(g) for g in grid]}, step=step)
            if (epoch + 1) % a.save_every == 0 or epoch + 1 == a.epochs:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "scaler": scaler.state_dict(), "epoch": epoch, "step": step, "args": vars(a)},
                           os.path.join(a.out, f"lam_ep{epoch:03d}.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
