"""
RQ-VAE item tokenizer with k-means codebook initialisation and a diversity loss that
discourages semantic-ID collisions (LETTER-style). DDP via torchrun.

    torchrun --nproc_per_node=8 17_rqvae_kmeans_init.py --emb data/instruments/llama_emb.npy \
        --save_dir ckpt/instruments_rqvae
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
from sklearn.cluster import KMeans
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--emb", required=True)
    p.add_argument("--save_dir", default="ckpt/rqvae")
    p.add_argument("--num_levels", type=int, default=4)
    p.add_argument("--codebook_size", type=int, default=256)
    p.add_argument("--e_dim", type=int, default=32)
    p.add_argument("--beta", type=float, default=0.25)
    p.add_argument("--div_weight", type=float, default=1e-4)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=3000)
    p.add_argument("--save_every", type=int, default=100)
    p.add_argument("--kmeans_sample", type=int, default=50000)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


class RQVAE(nn.Module):
    def __init__(self, in_dim, e_dim, num_levels, K, beta):
        super().__init__()
        h = [2048, 1024, 512, 256, 128, 64]
        enc, d = [], in_dim
        for w in h:
            enc += [nn.Linear(d, w), nn.ReLU()]
            d = w
        self.encoder = nn.Sequential(*enc, nn.Linear(d, e_dim))
        dec, d = [], e_dim
        for w in reversed(h):
            dec += [nn.Linear(d, w), nn.ReLU()]
            d = w
        self.decoder = nn.Sequential(*dec, nn.Linear(d, in_dim))
        self.codebooks = nn.ParameterList([nn.Parameter(torch.zeros(K, e_dim)) for _ in range(num_levels)])
        self.beta = beta

    @torch.no_grad()
    def kmeans_init(self, x, seed):
        r = self.encoder(x)
        for cb in self.codebooks:
            km = KMeans(n_clusters=cb.size(0), n_init=1, max_iter=100, random_state=seed).fit(r.cpu().numpy())
            c = torch.from_numpy(km.cluster_centers_).to(cb)
            cb.copy_(c)
            r = r - c[torch.from_numpy(km.labels_).to(r.device).long()]

    def forward(self, x):
        z = self.encoder(x)
        r, zq = z, torch.zeros_like(z)
        vq_loss, div_loss, codes = 0.0, 0.0, []
        for cb in self.codebooks:
            d = torch.cdist(r, cb)
            idx = d.argmin(1)
            q = cb[idx]
            vq_loss = vq_loss + F.mse_loss(q, r.detach()) + self.beta * F.mse_loss(r, q.detach())
            # spread assignments over the codebook
            p = F.softmax(-d, 1).mean(0)
            div_loss = div_loss + (p * torch.log(p + 1e-9)).sum()
            zq = zq + q
            r = r - q.detach()
            codes.append(idx)
        zq = z + (zq - z).detach()
        return self.decoder(zq), vq_loss, div_loss, torch.stack(codes, 1)


def save_checkpoint(path, model, opt, epoch, best):
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "best": best}, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.save_dir, exist_ok=True)

    emb = torch.from_numpy(np.load(args.emb)).float()
    ds = TensorDataset(emb)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)

    model = RQVAE(emb.size(1), args.e_dim, args.num_levels, args.codebook_size, args.beta).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)

    start, best = 0, float("inf")
    ckpts = sorted(glob.glob(os.path.join(args.save_dir, "epoch_*.pt")))
    if ckpts:
        state = torch.load(ckpts[-1], map_location=dev)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, best = state["epoch"] + 1, state["best"]
    else:
        g = np.random.default_rng(args.seed)
        sample = emb[g.choice(len(emb), min(len(emb), args.kmeans_sample), replace=False)].to(dev)
        model.kmeans_init(sample, args.seed)  # same sample and seed on every rank; DDP broadcasts anyway

    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(4, device=dev)
        for (x,) in loader:
            x = x.to(dev, non_blocking=True)
            x_hat, vq, div, _ = model(x)
            rec = F.mse_loss(x_hat, x)
            loss = rec + vq + args.div_weight * div
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([rec.detach(), vq.detach(), div.detach(), torch.ones((), device=dev)])
        dist.all_reduce(acc)
        rec_avg = (acc[0] / acc[3]).item()
        if rank == 0 and epoch % 10 == 0:
            print(f"epoch {epoch} rec {rec_avg:.5f} vq {(acc[1] / acc[3]).item():.5f} "
                  f"div {(acc[2] / acc[3]).item():.4f} {time.time() - t0:.1f}s", flush=True)

        if rec_avg < best:
            best = rec_avg
            save_checkpoint(os.path.join(args.save_dir, "best.pt"), model, opt, epoch, best)
        if (epoch + 1) % args.save_every == 0:
            save_checkpoint(os.path.join(args.save_dir, f"epoch_{epoch:05d}.pt"), model, opt, epoch, best)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
