"""Spiking Speech Commands (SSC) with a two-layer adaptive-LIF (ALIF) recurrent SNN.

Usage:
    torchrun --nproc_per_node=4 14_ssc_adaptive_lif.py --data /data/tonic --epochs 100
"""
import argparse
import math
import os
import time

import numpy as np
import tonic
import tonic.transforms as tt
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser(description="SSC ALIF-RSNN")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--data", default="/data/tonic")
    parser.add_argument("--save-dir", default="./output/ssc_alif")
    parser.add_argument("--bins", type=int, default=250)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rate-target", type=float, default=0.02)
    parser.add_argument("--rate-coef", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    return parser.parse_args()


class MultiGauss(torch.autograd.Function):
    """Multi-Gaussian surrogate (Yin et al. 2021)."""

    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return (v > 0).float()

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        lens, scale, hight = 0.5, 6.0, 0.15

        def gauss(x, mu, sigma):
            return torch.exp(-((x - mu) ** 2) / (2 * sigma ** 2)) / math.sqrt(2 * math.pi) / sigma

        sg = gauss(v, 0.0, lens) * (1.0 + hight) - gauss(v, lens, scale * lens) * hight \
            - gauss(v, -lens, scale * lens) * hight
        return g * sg


class ALIFLayer(nn.Module):
    def __init__(self, n_in, n_out, beta_adapt=1.8):
        super().__init__()
        self.ff = nn.Linear(n_in, n_out)
        self.rec = nn.Linear(n_out, n_out, bias=False)
        self.tau_m = nn.Parameter(torch.full((n_out,), 20.0))
        self.tau_a = nn.Parameter(torch.full((n_out,), 200.0))
        self.beta_adapt = beta_adapt
        nn.init.orthogonal_(self.rec.weight)

    def forward(self, x):  # [B, T, n_in]
        B, T, _ = x.shape
        cur = self.ff(x)
        n = self.rec.out_features
        v = x.new_zeros(B, n)
        a = x.new_zeros(B, n)
        s = x.new_zeros(B, n)
        alpha = torch.exp(-1.0 / self.tau_m.clamp(min=1.0))
        rho = torch.exp(-1.0 / self.tau_a.clamp(min=1.0))
        out = []
        for t in range(T):
            a = rho * a + (1 - rho) * s
            theta = 0.01 + self.beta_adapt * a
            v = alpha * v + (1 - alpha) * (cur[:, t] + self.rec(s)) - theta * s
            s = MultiGauss.apply(v - theta)
            out.append(s)
        return torch.stack(out, 1)


class RSNN(nn.Module):
    def __init__(self, n_in=700, hidden=512, n_out=35):
        super().__init__()
        self.l1 = ALIFLayer(n_in, hidden)
        self.l2 = ALIFLayer(hidden, hidden)
        self.readout = nn.Linear(hidden, n_out)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        s1 = self.l1(x)
        s2 = self.l2(self.drop(s1))
        logits = F.log_softmax(self.readout(s2), dim=-1).mean(1)  # average log-prob over time
        return logits, torch.stack([s1.mean(), s2.mean()])


def build_datasets(root, bins):
    tf = tt.Compose([tt.ToFrame(sensor_size=tonic.datasets.SSC.sensor_size, n_time_bins=bins),
                     lambda f: np.minimum(f.reshape(f.shape[0], -1), 1).astype(np.float32)])
    train = tonic.datasets.SSC(save_to=root, split="train", transform=tf)
    valid = tonic.datasets.SSC(save_to=root, split="valid", transform=tf)
    test = tonic.datasets.SSC(save_to=root, split="test", transform=tf)
    return train, valid, test


@torch.no_grad()
def accuracy(net, loader, device):
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        logp, _ = net(x.to(device, non_blocking=True))
        c[0] += (logp.argmax(1) == y.to(device)).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    if rank == 0:
        build_datasets(args.data, args.bins)
    dist.barrier()
    train_set, valid_set, test_set = build_datasets(args.data, args.bins)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)

    def shard_loader(ds):
        return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=256,
                          num_workers=args.workers, pin_memory=True)

    valid_loader, test_loader = shard_loader(valid_set), shard_loader(test_set)

    model = RSNN(hidden=args.hidden).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    lr = args.lr * math.sqrt(world)  # sqrt scaling works better than linear for Adam here
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.7, patience=5)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_valid = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        m = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logp, rates = model(x)
            loss = F.nll_loss(logp, y) + args.rate_coef * ((rates - args.rate_target) ** 2).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            m += torch.stack([loss.detach(), rates.mean().detach(), torch.ones((), device=device)])
        dist.all_reduce(m)

        valid_acc = accuracy(model.module, valid_loader, device)
        scheduler.step(valid_acc)  # same value on every rank, so the lr stays in sync
        if valid_acc > best_valid:
            best_valid = valid_acc
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "valid_acc": valid_acc},
                           os.path.join(args.save_dir, "best.pt"))
        if rank == 0:
            print(f"epoch {epoch:3d} loss {m[0] / m[2]:.4f} rate {m[1] / m[2]:.4f} valid {valid_acc:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)", flush=True)

    # final test with the best-on-validation weights
    dist.barrier()  # rank 0 may still be writing best.pt
    ck = torch.load(os.path.join(args.save_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ck["model"])
    test_acc = accuracy(model.module, test_loader, device)
    if rank == 0:
        print(f"best epoch {ck['epoch']} valid {ck['valid_acc']:.4f} test {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
