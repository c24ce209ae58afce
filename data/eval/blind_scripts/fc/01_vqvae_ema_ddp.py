"""Train a VQ-VAE tokenizer with an EMA codebook on 256x256 crops.

Launch:
    torchrun --nproc_per_node=8 01_vqvae_ema_ddp.py --data /datasets/ffhq/images256 --out runs/vqvae_ema_f8
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/vqvae_ema")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--codebook_size", type=int, default=8192)
    p.add_argument("--embed_dim", type=int, default=64)
    p.add_argument("--ch", type=int, default=128)
    p.add_argument("--decay", type=float, default=0.99)
    p.add_argument("--beta", type=float, default=0.25)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log_every", type=int, default=100)
    p.add_argument("--save_every", type=int, default=5)
    return p.parse_args()


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.block = nn.Sequential(
            nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1),
            nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1),
        )

    def forward(self, x):
        return x + self.block(x)


class Encoder(nn.Module):
    def __init__(self, ch, z_dim, n_down=3):
        super().__init__()
        layers = [nn.Conv2d(3, ch, 3, padding=1)]
        for _ in range(n_down):
            layers += [ResBlock(ch), nn.Conv2d(ch, ch, 4, stride=2, padding=1)]
        layers += [ResBlock(ch), ResBlock(ch), nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, z_dim, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self, ch, z_dim, n_up=3):
        super().__init__()
        layers = [nn.Conv2d(z_dim, ch, 3, padding=1), ResBlock(ch), ResBlock(ch)]
        for _ in range(n_up):
            layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(ch, ch, 3, padding=1), ResBlock(ch)]
        layers += [nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, z):
        return self.net(z)


class EMAQuantizer(nn.Module):
    """Vector quantizer with exponential moving average codebook updates (van den Oord et al. 2017, App. A.1)."""

    def __init__(self, num_codes, dim, decay=0.99, eps=1e-5):
        super().__init__()
        self.num_codes = num_codes
        self.dim = dim
        self.decay = decay
        self.eps = eps
        self.embed = nn.Embedding(num_codes, dim)
        self.embed.weight.data.uniform_(-1.0 / num_codes, 1.0 / num_codes)
        self.register_buffer("cluster_size", torch.zeros(num_codes))
        self.register_buffer("embed_avg", self.embed.weight.data.clone())

    def forward(self, z):
        b, c, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, c)
        dist_ = (flat.pow(2).sum(1, keepdim=True)
                 - 2 * flat @ self.embed.weight.t()
                 + self.embed.weight.pow(2).sum(1)[None, :])
        indices = dist_.argmin(1)
        quantized = self.embed(indices).view(b, h, w, c).permute(0, 3, 1, 2)

        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(indices, self.num_codes).type(flat.dtype)
                counts = onehot.sum(0)
                embed_sum = onehot.t() @ flat
                if dist.is_initialized():
                    dist.all_reduce(counts)
                    dist.all_reduce(embed_sum)
                self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(embed_sum, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                smoothed = (self.cluster_size + self.eps) / (n + self.num_codes * self.eps) * n
                self.embed.weight.data.copy_(self.embed_avg / smoothed.unsqueeze(1))

        commit_loss = F.mse_loss(z, quantized.detach())
        quantized = z + (quantized - z).detach()
        return quantized, commit_loss, indices.view(b, h, w)


class VQVAE(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.encoder = Encoder(args.ch, args.embed_dim)
        self.quantizer = EMAQuantizer(args.codebook_size, args.embed_dim, decay=args.decay)
        self.decoder = Decoder(args.ch, args.embed_dim)

    def forward(self, x):
        z = self.encoder(x)
        zq, commit, idx = self.quantizer(z)
        return self.decoder(zq), commit, idx


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)

    tf = transforms.Compose([
        transforms.Resize(args.resolution),
        transforms.RandomCrop(args.resolution),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = VQVAE(args).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.9))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            xrec, commit, idx = model(x)
            rec_loss = F.mse_loss(xrec, x)
            loss = rec_loss + args.beta * commit

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if step % args.log_every == 0:
                with torch.no_grad():
                    used = torch.zeros(args.codebook_size, device=device)
                    used.index_fill_(0, idx.flatten().unique(), 1.0)
                    dist.all_reduce(used, op=dist.ReduceOp.MAX)
                    stats = torch.stack([rec_loss.detach(), commit.detach()])
                    dist.all_reduce(stats)
                    stats /= world
                if rank == 0:
                    cs = model.module.quantizer.cluster_size
                    p = cs / cs.sum()
                    perplexity = torch.exp(-(p * torch.log(p + 1e-10)).sum()).item()
                    print(f"ep {epoch} step {step} rec {stats[0]:.4f} commit {stats[1]:.4f} "
                          f"used {int(used.sum())}/{args.codebook_size} ppl {perplexity:.1f} "
                          f"{(time.time() - t0) / args.log_every:.3f}s/it", flush=True)
                    t0 = time.time()

        if rank == 0:
            save_image(torch.cat([x[:8], xrec[:8]]) * 0.5 + 0.5,
                       os.path.join(args.out, "samples", f"ep{epoch:04d}.png"), nrow=8)
            if (epoch + 1) % args.save_every == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "epoch": epoch, "step": step, "args": vars(args)},
                           os.path.join(args.out, f"vqvae_ep{epoch:04d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
