"""Conditional flow matching over protein C-alpha traces (FoldFlow / Genie-lite).

Proteins are cropped to --max-len residues and padded; a residue mask marks
real positions. The vector field network is an EGNN with sequence-distance
features. Every --sample-every epochs each rank integrates the ODE for a few
backbones and we report CA-CA bond geometry and clash rate over all ranks.

    torchrun --standalone --nproc_per_node=8 03_ca_flow_matching.py --index data/cath_s40_ca.pt
"""
import argparse
import os
import math
import time

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
import wandb


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", required=True, help="torch file with a list of [L,3] CA tensors")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--ode-steps", type=int, default=100)
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--samples-per-rank", type=int, default=8)
    ap.add_argument("--ckpt-dir", default="checkpoints/ca_fm")
    ap.add_argument("--project", default="prot-gen")
    return ap.parse_args()


class CATraces(Dataset):
    def __init__(self, path, min_len, max_len):
        traces = torch.load(path)
        self.items = [t for t in traces if t.shape[0] >= min_len]
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ca = self.items[i].float()
        L = ca.shape[0]
        if L > self.max_len:
            s = torch.randint(0, L - self.max_len + 1, (1,)).item()
            ca = ca[s:s + self.max_len]
            L = self.max_len
        x = torch.zeros(self.max_len, 3)
        m = torch.zeros(self.max_len, dtype=torch.bool)
        x[:L] = ca - ca.mean(0)
        m[:L] = True
        return x / 10.0, m  # nm scale


def masked_center(x, m):
    w = m.unsqueeze(-1).float()
    return (x - (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)) * w


class EGNNBlock(nn.Module):
    def __init__(self, dim, n_rel=65):
        super().__init__()
        self.rel = nn.Embedding(n_rel, dim)
        self.n_rel = n_rel
        self.msg = nn.Sequential(nn.Linear(3 * dim + 1, dim), nn.SiLU(), nn.Linear(dim, dim), nn.SiLU())
        self.upd = nn.Sequential(nn.LayerNorm(2 * dim), nn.Linear(2 * dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.coord = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, h, x, m):
        B, L, D = h.shape
        idx = torch.arange(L, device=h.device)
        rel = (idx[None, :] - idx[:, None]).clamp(-(self.n_rel // 2), self.n_rel // 2) + self.n_rel // 2
        diff = x[:, :, None] - x[:, None, :]
        d2 = diff.pow(2).sum(-1, keepdim=True)
        pair = torch.cat([h[:, :, None].expand(B, L, L, D), h[:, None].expand(B, L, L, D),
                          self.rel(rel).expand(B, L, L, D), d2], -1)
        e_mask = (m[:, :, None] & m[:, None, :]).unsqueeze(-1).float()
        msg = self.msg(pair) * e_mask
        n_nb = e_mask.sum(2).clamp(min=1)
        h = h + self.upd(torch.cat([h, msg.sum(2) / n_nb], -1)) * m.unsqueeze(-1)
        x = x + (diff / (d2.sqrt() + 1) * self.coord(msg) * e_mask).sum(2) / n_nb
        return h, masked_center(x, m)


class VectorField(nn.Module):
    def __init__(self, dim, depth):
        super().__init__()
        self.t_embed = nn.Sequential(nn.Linear(16, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([EGNNBlock(dim) for _ in range(depth)])

    def time_features(self, t):
        freqs = torch.exp(torch.linspace(0, math.log(1000), 8, device=t.device))
        ang = t[:, None] * freqs[None]
        return torch.cat([ang.sin(), ang.cos()], -1)

    def forward(self, x_t, t, m):
        h = self.t_embed(self.time_features(t))[:, None].expand(-1, x_t.shape[1], -1)
        h = h * m.unsqueeze(-1)
        x = x_t
        for blk in self.blocks:
            h, x = blk(h, x, m)
        return masked_center(x - x_t, m)

    @torch.no_grad()
    def sample(self, m, n_steps=100):
        x = masked_center(torch.randn(*m.shape, 3, device=m.device), m)
        ts = torch.linspace(0, 1, n_steps + 1, device=m.device)
        for i in range(n_steps):
            t = ts[i].expand(m.shape[0])
            x = x + (ts[i + 1] - ts[i]) * self(x, t, m)
        return x


def fm_loss(net, x1, m):
    B = x1.shape[0]
    x1 = masked_center(x1, m)
    x0 = masked_center(torch.randn_like(x1), m)
    t = torch.rand(B, device=x1.device)
    xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * x1
    v = net(xt, t, m)
    err = ((v - (x1 - x0)) ** 2).sum(-1) * m
    return err.sum() / m.sum()


def backbone_stats(x, m):
    """CA-CA bond deviation from 3.8 A and fraction of clashing pairs (< 3 A)."""
    x = x * 10.0
    bond = (x[:, 1:] - x[:, :-1]).norm(dim=-1)
    bm = (m[:, 1:] & m[:, :-1]).float()
    bond_dev = ((bond - 3.8).abs() * bm).sum()
    d = torch.cdist(x, x)
    L = x.shape[1]
    far = (torch.arange(L, device=x.device)[None] - torch.arange(L, device=x.device)[:, None]).abs() > 2
    pm = (m[:, :, None] & m[:, None, :] & far).float()
    clashes = ((d < 3.0).float() * pm).sum()
    return torch.stack([bond_dev, bm.sum(), clashes, pm.sum()])


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17 + rank)

    ds = CATraces(args.index, args.min_len, args.max_len)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, persistent_workers=True)

    net = VectorField(args.dim, args.depth).to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank])
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2000))

    if rank == 0:
        wandb.init(project=args.project, config=vars(args))
        os.makedirs(args.ckpt_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x1, m in loader:
            x1, m = x1.to(device, non_blocking=True), m.to(device, non_blocking=True)
            loss = fm_loss(model, x1, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            ema.update_parameters(net)
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1

        dist.all_reduce(running)
        if rank == 0:
            wandb.log({"train/loss": (running[0] / running[1]).item(), "epoch": epoch,
                       "lr": sched.get_last_lr()[0], "epoch_time": time.time() - t0}, step=step)

        if (epoch + 1) % args.sample_every == 0:
            model.eval()
            lengths = torch.randint(60, args.max_len + 1, (args.samples_per_rank,), device=device)
            m = torch.arange(args.max_len, device=device)[None] < lengths[:, None]
            x = model.sample(m, n_steps=args.ode_steps)
            stats = backbone_stats(x, m)
            dist.all_reduce(stats)
            if rank == 0:
                wandb.log({"sample/ca_bond_dev": (stats[0] / stats[1]).item(),
                           "sample/clash_frac": (stats[2] / stats[3]).item()}, step=step)

        if rank == 0:
            torch.save({"model": net.state_dict(), "ema": ema.module.state_dict(),
                        "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.ckpt_dir, f"epoch{epoch:04d}.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
