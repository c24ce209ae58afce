"""RQ-VAE semantic-ID tokenizer trained with DDP (torchrun).

    torchrun --nproc_per_node=4 08_rqvae_ddp_train.py --item_emb data/yelp/item_text_emb.npy

Produces ckpt/rqvae_yelp/last.pt; semantic IDs are exported by export_sem_ids.py.
"""
import argparse
import math
import os
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    item_emb: str = ""
    out_dir: str = "ckpt/rqvae_yelp"
    e_dim: int = 32
    layers: tuple = (512, 256, 128, 64)
    num_codebooks: int = 3
    codebook_size: int = 256
    beta: float = 0.25
    dropout: float = 0.0
    batch_size: int = 1024
    lr: float = 1e-3
    weight_decay: float = 1e-4
    epochs: int = 500
    warmup_epochs: int = 10
    eval_every: int = 25
    seed: int = 2023


class EmbDataset(Dataset):
    def __init__(self, path):
        self.emb = np.load(path).astype(np.float32)

    def __len__(self):
        return len(self.emb)

    def __getitem__(self, idx):
        return torch.from_numpy(self.emb[idx]), idx


class VQ(nn.Module):
    def __init__(self, n, dim, beta):
        super().__init__()
        self.embedding = nn.Embedding(n, dim)
        self.embedding.weight.data.uniform_(-1.0 / n, 1.0 / n)
        self.beta = beta

    def forward(self, x):
        d = (x.pow(2).sum(1, keepdim=True) + self.embedding.weight.pow(2).sum(1)
             - 2 * x @ self.embedding.weight.t())
        idx = d.argmin(1)
        xq = self.embedding(idx)
        loss = F.mse_loss(xq, x.detach()) + self.beta * F.mse_loss(xq.detach(), x)
        xq = x + (xq - x).detach()
        return xq, loss, idx


class RQ(nn.Module):
    def __init__(self, num_codebooks, n, dim, beta):
        super().__init__()
        self.vq_layers = nn.ModuleList([VQ(n, dim, beta) for _ in range(num_codebooks)])

    def forward(self, x):
        residual, xq = x, 0
        losses, idxs = [], []
        for vq in self.vq_layers:
            r_q, l, i = vq(residual)
            residual = residual - r_q
            xq = xq + r_q
            losses.append(l)
            idxs.append(i)
        return xq, torch.stack(losses).mean(), torch.stack(idxs, -1)


def mlp(dims, dropout):
    mods = []
    for a, b in zip(dims[:-1], dims[1:]):
        mods += [nn.Dropout(dropout), nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


class RQVAE(nn.Module):
    def __init__(self, in_dim, cfg: Config):
        super().__init__()
        dims = [in_dim, *cfg.layers, cfg.e_dim]
        self.encoder = mlp(dims, cfg.dropout)
        self.rq = RQ(cfg.num_codebooks, cfg.codebook_size, cfg.e_dim, cfg.beta)
        self.decoder = mlp(dims[::-1], cfg.dropout)

    def forward(self, x):
        z = self.encoder(x)
        zq, rq_loss, codes = self.rq(z)
        return self.decoder(zq), rq_loss, codes


def lr_lambda(cfg, steps_per_epoch):
    warm = cfg.warmup_epochs * steps_per_epoch
    total = cfg.epochs * steps_per_epoch

    def f(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))
    return f


@torch.no_grad()
def collision_rate(model, emb, device, bs=8192):
    model.eval()
    codes = []
    for i in range(0, len(emb), bs):
        x = torch.from_numpy(emb[i:i + bs]).to(device)
        codes.append(model(x)[2].cpu())
    model.train()
    codes = torch.cat(codes)
    n_unique = torch.unique(codes, dim=0).size(0)
    return 1.0 - n_unique / codes.size(0)


def main():
    p = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        if isinstance(v, tuple):
            p.add_argument(f"--{k}", type=int, nargs="+", default=list(v))
        else:
            p.add_argument(f"--{k}", type=type(v), default=v)
    cfg = Config(**vars(p.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    data = EmbDataset(cfg.item_emb)
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = RQVAE(data.emb.shape[1], cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, len(loader)))

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(cfg.out_dir)

    step = 0
    best_coll = 1.0
    for epoch in range(cfg.epochs):
        totals = torch.zeros(3, device=device)
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            x_hat, rq_loss, _ = model(x)
            recon = F.mse_loss(x_hat, x, reduction="mean")
            loss = recon + rq_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            totals += torch.stack([recon.detach(), rq_loss.detach(), torch.ones((), device=device)])
            step += 1
        dist.all_reduce(totals)

        if rank == 0:
            writer.add_scalar("loss/recon", (totals[0] / totals[2]).item(), epoch)
            writer.add_scalar("loss/rq", (totals[1] / totals[2]).item(), epoch)
            writer.add_scalar("lr", sched.get_last_lr()[0], epoch)
            if (epoch + 1) % cfg.eval_every == 0:
                coll = collision_rate(model.module, data.emb, device)
                writer.add_scalar("collision_rate", coll, epoch)
                print(f"epoch {epoch + 1}: recon {(totals[0] / totals[2]).item():.5f} collision {coll:.4f}")
                ckpt = {"state_dict": model.module.state_dict(), "config": asdict(cfg), "epoch": epoch}
                torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
                if coll < best_coll:
                    best_coll = coll
                    torch.save(ckpt, os.path.join(cfg.out_dir, "best_collision.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
