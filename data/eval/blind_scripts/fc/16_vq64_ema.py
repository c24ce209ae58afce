"""EMA-codebook VQGAN-lite for 64x64 (ImageNet-64 / downsampled), codebook initialised with k-means++
seeds from the first batch and dead codes restarted every `restart_every` steps.

    torchrun --nproc_per_node=8 16_vq64_ema.py --data /data/imagenet64_npz --out runs/vq64_ema
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class NpzImages(Dataset):
    """Downsampled ImageNet as distributed by image-net.org (train_data_batch_*.npz, uint8 flattened)."""

    def __init__(self, root):
        xs = [np.load(f)["data"] for f in sorted(glob.glob(os.path.join(root, "train_data_batch_*.npz")))]
        self.x = np.concatenate(xs).reshape(-1, 3, 64, 64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        img = torch.from_numpy(self.x[i]).float() / 127.5 - 1
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return img


class EMACodebook(nn.Module):
    def __init__(self, k, d, decay=0.99, eps=1e-5):
        super().__init__()
        self.k, self.d, self.decay, self.eps = k, d, decay, eps
        self.register_buffer("embed", torch.randn(k, d))
        self.register_buffer("cluster_size", torch.zeros(k))
        self.register_buffer("embed_sum", torch.randn(k, d))
        self.register_buffer("initted", torch.tensor(False))

    @torch.no_grad()
    def _init(self, flat):
        # rank 0 picks initial codes from its batch, everyone receives the same codebook
        if dist.get_rank() == 0:
            perm = torch.randperm(flat.shape[0], device=flat.device)[: self.k]
            self.embed.copy_(flat[perm])
        dist.broadcast(self.embed, 0)
        self.embed_sum.copy_(self.embed)
        self.cluster_size.fill_(1.0)
        self.initted.fill_(True)

    def forward(self, z):
        b, c, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, c)
        if self.training and not self.initted:
            self._init(flat.detach())
        idx = torch.cdist(flat.detach(), self.embed).argmin(1)
        q = F.embedding(idx, self.embed)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, self.k).to(flat.dtype)
                n = onehot.sum(0)
                s = onehot.t() @ flat.detach()
                dist.all_reduce(n)
                dist.all_reduce(s)
                self.cluster_size.lerp_(n, 1 - self.decay)
                self.embed_sum.lerp_(s, 1 - self.decay)
                tot = self.cluster_size.sum()
                cs = (self.cluster_size + self.eps) / (tot + self.k * self.eps) * tot
                self.embed.copy_(self.embed_sum / cs[:, None])
        commit = F.mse_loss(flat, q.detach())
        q = flat + (q - flat).detach()
        return q.view(b, h, w, c).permute(0, 3, 1, 2), commit, idx.view(b, h, w)

    @torch.no_grad()
    def restart_dead(self, flat, threshold=1.0):
        dead = self.cluster_size < threshold
        nd = int(dead.sum())
        if nd:
            new = torch.empty(nd, self.d, device=flat.device)
            if dist.get_rank() == 0:
                new.copy_(flat[torch.randint(0, flat.shape[0], (nd,), device=flat.device)])
            dist.broadcast(new, 0)
            self.embed[dead] = new
            self.embed_sum[dead] = new
            self.cluster_size[dead] = threshold
        return nd


def block(cin, cout):
    return nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, 1, 1))


class VQ64(nn.Module):
    def __init__(self, ch=128, d=64, k=4096):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, ch, 3, 1, 1), block(ch, ch), nn.Conv2d(ch, 2 * ch, 4, 2, 1),
                                 block(2 * ch, 2 * ch), nn.Conv2d(2 * ch, 2 * ch, 4, 2, 1), block(2 * ch, 2 * ch),
                                 nn.Conv2d(2 * ch, d, 1))
        self.cb = EMACodebook(k, d)
        self.dec = nn.Sequential(nn.Conv2d(d, 2 * ch, 3, 1, 1), block(2 * ch, 2 * ch),
                                 nn.ConvTranspose2d(2 * ch, 2 * ch, 4, 2, 1), block(2 * ch, 2 * ch),
                                 nn.ConvTranspose2d(2 * ch, ch, 4, 2, 1), block(ch, ch), nn.Conv2d(ch, 3, 3, 1, 1))

    def forward(self, x):
        z = self.enc(x)
        q, commit, idx = self.cb(z)
        return self.dec(q), commit, idx, z


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--beta", type=float, default=0.25)
    ap.add_argument("--log_every", type=int, default=200)
    ap.add_argument("--restart_every", type=int, default=1000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    ds = NpzImages(args.data)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    model = DDP(VQ64(k=args.k).to(dev), device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="vq64", config=vars(args), dir=args.out)

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x in dl:
            x = x.to(dev, non_blocking=True)
            xr, commit, idx, z = model(x)
            rec = F.mse_loss(xr, x)
            loss = rec + args.beta * commit
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if step % args.restart_every == 0:
                flat = z.detach().permute(0, 2, 3, 1).reshape(-1, z.shape[1])
                n_restarted = model.module.cb.restart_dead(flat)
            else:
                n_restarted = 0

            if rank == 0 and step % args.log_every == 0:
                usage = torch.bincount(idx.flatten(), minlength=args.k).float()
                losses = torch.stack([rec.detach(), commit.detach()])
                dist.all_reduce(usage)
                dist.all_reduce(losses)
                losses /= world
                p = usage / usage.sum()
                ppl = torch.exp(-(p * torch.log(p + 1e-10)).sum()).item()
                wandb.log({"rec": losses[0].item(), "commit": losses[1].item(), "perplexity": ppl,
                           "active_codes": int((usage > 0).sum()), "restarted": n_restarted,
                           "sec_per_it": (time.time() - t0) / args.log_every}, step=step)
                t0 = time.time()

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, "vq64_last.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
