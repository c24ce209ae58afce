"""VQ-VAE tokenizer with EMA codebook, codebook kept as buffers and synchronised by hand
(so DDP does not need to broadcast buffers), dead codes restarted from encoder outputs gathered
from all ranks, and reconstruction FID on the validation set.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        18_vqvae_ema_restart.py --train /shared/ffhq/train --val /shared/ffhq/val --out /shared/runs/vq_ema
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy import linalg
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from pytorch_fid.inception import InceptionV3

from lab_models.vqgan_blocks import Decoder, Encoder


class EMAVectorQuantizer(nn.Module):
    def __init__(self, k, d, decay=0.99, eps=1e-5):
        super().__init__()
        self.k, self.d, self.decay, self.eps = k, d, decay, eps
        embed = torch.randn(k, d) * 0.01
        self.register_buffer("embed", embed)
        self.register_buffer("ema_n", torch.ones(k))
        self.register_buffer("ema_w", embed.clone())
        self.register_buffer("usage", torch.zeros(k))

    def forward(self, z):
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        idx = torch.cdist(flat.detach().float(), self.embed).argmin(1)
        zq = self.embed[idx]
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, self.k).float()
                n = onehot.sum(0)
                wsum = onehot.t() @ flat.detach().float()
                # every rank sees the same totals -> identical codebooks without buffer broadcast
                dist.all_reduce(n)
                dist.all_reduce(wsum)
                self.ema_n.mul_(self.decay).add_(n, alpha=1 - self.decay)
                self.ema_w.mul_(self.decay).add_(wsum, alpha=1 - self.decay)
                tot = self.ema_n.sum()
                n_s = (self.ema_n + self.eps) / (tot + self.k * self.eps) * tot
                self.embed.copy_(self.ema_w / n_s[:, None])
                self.usage.add_(n)
        commit = F.mse_loss(flat, zq.detach())
        zq = flat + (zq - flat).detach()
        return zq.view(b, h, w, d).permute(0, 3, 1, 2), commit, idx.view(b, h, w)

    @torch.no_grad()
    def restart_dead(self, local_feats, min_usage=1.0):
        """usage is identical on all ranks (built from all-reduced counts), so every rank takes the same branch."""
        dead = self.usage < min_usage
        n_dead = int(dead.sum().item())
        if n_dead > 0:
            world = dist.get_world_size()
            m = min(local_feats.shape[0], 4096)
            pool = torch.empty(world * m, self.d, device=local_feats.device)
            dist.all_gather_into_tensor(pool, local_feats[:m].float().contiguous())
            g = torch.Generator(device=pool.device).manual_seed(int(self.usage.sum().item()) % (2 ** 31))
            pick = torch.randint(0, pool.shape[0], (n_dead,), device=pool.device, generator=g)
            self.embed[dead] = pool[pick]
            self.ema_w[dead] = pool[pick]
            self.ema_n[dead] = 1.0
        self.usage.zero_()
        return n_dead


class VQVAE(nn.Module):
    def __init__(self, k=16384, d=8):
        super().__init__()
        self.encoder = Encoder(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z_channels=d)
        self.decoder = Decoder(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, z_channels=d)
        self.quantizer = EMAVectorQuantizer(k, d)

    def forward(self, x):
        z = self.encoder(x)
        zq, commit, idx = self.quantizer(z)
        return self.decoder(zq), commit, idx, z


def frechet(mu1, s1, mu2, s2):
    covmean, _ = linalg.sqrtm(s1.dot(s2), disp=False)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean.real))


@torch.no_grad()
def recon_fid(model, inception, loader, device, world):
    model.eval()
    real, fake = [], []
    for x, _ in loader:
        x = x.to(device)
        xr = model.module(x)[0].clamp(-1, 1)
        real.append(inception((x + 1) / 2)[0].flatten(1))
        fake.append(inception((xr + 1) / 2)[0].flatten(1))
    real, fake = torch.cat(real), torch.cat(fake)
    out = []
    for t in (real, fake):
        buf = torch.empty(world * t.shape[0], t.shape[1], device=device)
        dist.all_gather_into_tensor(buf, t.contiguous())
        out.append(buf.double().cpu().numpy())
    model.train()
    r, f = out
    return frechet(r.mean(0), np.cov(r, rowvar=False), f.mean(0), np.cov(f, rowvar=False))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--restart_every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(256), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    train_ds = datasets.ImageFolder(args.train, tf)
    val_ds = datasets.ImageFolder(args.val, tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # drop_last so that all ranks gather equal-sized feature blocks
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8, drop_last=True,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=32, sampler=val_sampler, num_workers=4, drop_last=False)

    model = DDP(VQVAE().to(device), device_ids=[local_rank], broadcast_buffers=False)
    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.9))

    ck_path = os.path.join(args.out, "last.pt")
    start_epoch, step = 0, 0
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for x, _ in train_dl:
            x = x.to(device, non_blocking=True)
            xr, commit, idx, z = model(x)
            loss = F.l1_loss(xr, x) + 0.25 * commit
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % args.restart_every == 0:
                feats = z.detach().permute(0, 2, 3, 1).reshape(-1, z.shape[1])
                feats = feats[torch.randperm(feats.shape[0], device=device)]
                n_dead = model.module.quantizer.restart_dead(feats)
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {l.item():.4f} restarted {n_dead} codes", flush=True)

        fid = recon_fid(model, inception, val_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch} rFID {fid:.3f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "step": step, "rfid": fid}, ck_path + ".tmp")
            os.replace(ck_path + ".tmp", ck_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
