#!/usr/bin/env python
# RQ-VAE item tokenizer: item text embeddings (sentence-t5, 768-d) -> L codes of K entries.
# Multi-GPU with torch.multiprocessing.spawn, one process per visible GPU.
#
#   python 02_rqvae_tokenizer_spawn.py --emb data/item_emb.npy --out ckpt/rqvae
import argparse
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ItemEmbeddings(Dataset):
    def __init__(self, path):
        self.x = np.load(path, mmap_mode="r")

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(np.asarray(self.x[i], dtype=np.float32))


def mlp(dims, bn=True):
    layers = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            if bn:
                layers.append(nn.BatchNorm1d(dims[i + 1]))
            layers.append(nn.SiLU())
    return nn.Sequential(*layers)


class RQVAE(nn.Module):
    def __init__(self, in_dim=768, hidden=(512, 256, 128), latent=32, levels=3, K=256, beta=0.25):
        super().__init__()
        self.encoder = mlp([in_dim, *hidden, latent])
        self.decoder = mlp([latent, *reversed(hidden), in_dim])
        self.codebooks = nn.ParameterList([nn.Parameter(torch.randn(K, latent) * 0.01) for _ in range(levels)])
        self.beta = beta
        self.K = K

    def quantize(self, z):
        residual = z
        z_q = torch.zeros_like(z)
        codes, vq_loss = [], z.new_zeros(())
        for cb in self.codebooks:
            d = residual.pow(2).sum(1, keepdim=True) - 2 * residual @ cb.t() + cb.pow(2).sum(1)[None]
            idx = d.argmin(1)
            q = cb[idx]
            vq_loss = vq_loss + F.mse_loss(q, residual.detach()) + self.beta * F.mse_loss(residual, q.detach())
            z_q = z_q + q
            residual = residual - q
            codes.append(idx)
        return z_q, torch.stack(codes, 1), vq_loss

    def forward(self, x):
        z = self.encoder(x)
        z_q, codes, vq_loss = self.quantize(z)
        z_q = z + (z_q - z).detach()
        x_hat = self.decoder(z_q)
        return x_hat, codes, vq_loss


@torch.no_grad()
def kmeans(x, k, iters=20):
    centers = x[torch.randperm(x.size(0), device=x.device)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(x, centers).argmin(1)
        for j in range(k):
            m = assign == j
            if m.any():
                centers[j] = x[m].mean(0)
    return centers


@torch.no_grad()
def init_codebooks(model, sample, rank):
    """k-means on rank 0, residual level by level, then broadcast so every rank starts equal."""
    if rank == 0:
        model.eval()
        residual = model.encoder(sample)
        for cb in model.codebooks:
            c = kmeans(residual, cb.size(0))
            cb.data.copy_(c)
            residual = residual - c[torch.cdist(residual, c).argmin(1)]
        model.train()
    for cb in model.codebooks:
        dist.broadcast(cb.data, src=0)


@torch.no_grad()
def reset_dead_codes(model, usage, batch_z, rank):
    """Replace codes unused over the last interval with random encoder outputs picked on rank 0."""
    for lvl, cb in enumerate(model.codebooks):
        dead = (usage[lvl] == 0)
        n_dead = int(dead.sum().item())  # usage was all-reduced, same on every rank
        if n_dead == 0:
            continue
        repl = torch.empty(n_dead, cb.size(1), device=cb.device)
        if rank == 0:
            repl.copy_(batch_z[torch.randint(0, batch_z.size(0), (n_dead,), device=cb.device)])
        dist.broadcast(repl, src=0)
        cb.data[dead] = repl


def find_free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    ds = ItemEmbeddings(args.emb)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = RQVAE(in_dim=ds.x.shape[1], latent=args.latent, levels=args.levels, K=args.K).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

    sample_idx = np.random.default_rng(args.seed).choice(len(ds), size=min(len(ds), 20000), replace=False)
    sample = torch.from_numpy(np.asarray(ds.x[np.sort(sample_idx)], dtype=np.float32)).to(device)
    init_codebooks(model, sample, rank)

    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=1e-4)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        usage = torch.zeros(args.levels, args.K, device=device)
        tot = torch.zeros(3, device=device)
        last_z = None
        for x in loader:
            x = x.to(device, non_blocking=True)
            x_hat, codes, vq_loss = ddp(x)
            recon = F.mse_loss(x_hat, x)
            loss = recon + vq_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            for lvl in range(args.levels):
                usage[lvl] += torch.bincount(codes[:, lvl], minlength=args.K).float()
            tot += torch.stack([recon.detach(), vq_loss.detach(), torch.ones((), device=device)])
            last_z = x
        dist.all_reduce(usage)
        dist.all_reduce(tot)
        if (epoch + 1) % args.reset_every == 0:
            with torch.no_grad():
                model.eval()
                z = model.encoder(last_z)
                model.train()
            reset_dead_codes(model, usage, z, rank)
        if rank == 0:
            util = (usage > 0).float().mean(1).tolist()
            print(f"[{epoch:04d}] recon {tot[0] / tot[2]:.5f} vq {tot[1] / tot[2]:.5f} "
                  f"util {' '.join(f'{u:.2f}' for u in util)}", flush=True)
            if (epoch + 1) % args.save_every == 0:
                torch.save({"model": model.state_dict(), "args": vars(args), "epoch": epoch},
                           os.path.join(args.out, "rqvae.pt"))

    # encode the whole catalogue once on rank 0 with the frozen tokenizer
    if rank == 0:
        model.eval()
        all_codes = []
        full = DataLoader(ds, batch_size=4096, shuffle=False, num_workers=4)
        with torch.no_grad():
            for x in full:
                _, codes, _ = model(x.to(device))
                all_codes.append(codes.cpu())
        all_codes = torch.cat(all_codes).numpy()
        _, counts = np.unique(all_codes, axis=0, return_counts=True)
        print(f"unique prefixes {len(counts)}/{len(all_codes)}, max collision {counts.max()}")
        np.save(os.path.join(args.out, "codes_raw.npy"), all_codes)
        torch.save({"model": model.state_dict(), "args": vars(args)}, os.path.join(args.out, "rqvae.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--emb", required=True)
    p.add_argument("--out", default="ckpt/rqvae")
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--K", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--reset_every", type=int, default=10)
    p.add_argument("--save_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    os.makedirs(args.out, exist_ok=True)
    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
