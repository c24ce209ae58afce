"""E(3)-equivariant diffusion (EDM) on QM9, dense batching with padding masks.

Launch:
    torchrun --nproc_per_node=8 01_edm_qm9_dense.py --data data/qm9_edm.npz --out runs/edm_qm9
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

ATOM_TYPES = [1, 6, 7, 8, 9]  # H C N O F
MAX_ATOMS = 29


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/edm_qm9")
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--timesteps", type=int, default=1000)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class QM9Dense(Dataset):
    def __init__(self, path):
        d = np.load(path)
        self.pos = torch.from_numpy(d["positions"]).float()      # [M, 29, 3]
        self.charges = torch.from_numpy(d["charges"]).long()     # [M, 29]
        self.n_atoms = torch.from_numpy(d["num_atoms"]).long()   # [M]
        lut = torch.full((10,), -1, dtype=torch.long)
        for i, z in enumerate(ATOM_TYPES):
            lut[z] = i
        self.types = lut[self.charges.clamp(max=9)]

    def __len__(self):
        return self.pos.shape[0]

    def __getitem__(self, i):
        n = self.n_atoms[i]
        mask = torch.zeros(MAX_ATOMS, dtype=torch.bool)
        mask[:n] = True
        return self.pos[i], self.types[i].clamp(min=0), mask


def remove_mean(x, mask):
    m = mask.unsqueeze(-1).float()
    mean = (x * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
    return (x - mean) * m


class EGCL(nn.Module):
    def __init__(self, hidden, norm_factor=100.0):
        super().__init__()
        self.norm_factor = norm_factor
        self.edge_mlp = nn.Sequential(nn.Linear(2 * hidden + 1, hidden), nn.SiLU(),
                                      nn.Linear(hidden, hidden), nn.SiLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.coord_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1, bias=False))
        nn.init.xavier_uniform_(self.coord_mlp[-1].weight, gain=0.001)

    def forward(self, h, x, node_mask, edge_mask):
        B, N, H = h.shape
        diff = x.unsqueeze(2) - x.unsqueeze(1)
        d2 = (diff ** 2).sum(-1, keepdim=True)
        hi = h.unsqueeze(2).expand(B, N, N, H)
        hj = h.unsqueeze(1).expand(B, N, N, H)
        m = self.edge_mlp(torch.cat([hi, hj, d2], -1)) * edge_mask
        h = h + self.node_mlp(torch.cat([h, m.sum(2) / self.norm_factor], -1)) * node_mask
        trans = diff / (torch.sqrt(d2 + 1e-8) + 1.0) * self.coord_mlp(m) * edge_mask
        x = x + trans.sum(2) / self.norm_factor * node_mask
        return h, x


class EGNNDynamics(nn.Module):
    def __init__(self, n_types, hidden, layers):
        super().__init__()
        self.embed = nn.Linear(n_types + 1, hidden)
        self.layers = nn.ModuleList([EGCL(hidden) for _ in range(layers)])
        self.out = nn.Linear(hidden, n_types)

    def forward(self, x, h, t, mask):
        node_mask = mask.unsqueeze(-1).float()
        edge_mask = (mask.unsqueeze(1) & mask.unsqueeze(2)).unsqueeze(-1).float()
        eye = torch.eye(mask.shape[1], device=x.device).unsqueeze(0).unsqueeze(-1)
        edge_mask = edge_mask * (1 - eye)
        tt = t.view(-1, 1, 1).expand(-1, h.shape[1], 1)
        hh = self.embed(torch.cat([h, tt], -1)) * node_mask
        xx = x
        for layer in self.layers:
            hh, xx = layer(hh, xx, node_mask, edge_mask)
        eps_x = remove_mean(xx - x, mask)
        eps_h = self.out(hh) * node_mask
        return eps_x, eps_h


def cosine_alphas_cumprod(T, s=0.008):
    steps = torch.arange(T + 1, dtype=torch.float64) / T
    f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    ac = (f / f[0]).clamp(min=1e-5)
    return ac.float()


def diffusion_loss(model, pos, types, mask, acp, T, n_types):
    B = pos.shape[0]
    t = torch.randint(1, T + 1, (B,), device=pos.device)
    a = acp[t].view(B, 1, 1)
    x0 = remove_mean(pos, mask)
    h0 = F.one_hot(types, n_types).float() * 0.25 * mask.unsqueeze(-1)
    ex = remove_mean(torch.randn_like(x0), mask)
    eh = torch.randn_like(h0) * mask.unsqueeze(-1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * ex
    ht = a.sqrt() * h0 + (1 - a).sqrt() * eh
    px, ph = model(xt, ht, t.float() / T, mask)
    denom = mask.sum(1).clamp(min=1) * (3 + n_types)
    err = ((px - ex) ** 2).sum((1, 2)) + ((ph - eh) ** 2).sum((1, 2))
    return (err / denom).mean()


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for pe, p in zip(ema_model.parameters(), model.parameters()):
        pe.mul_(decay).add_(p.detach(), alpha=1 - decay)


@torch.no_grad()
def evaluate(model, loader, acp, T, n_types, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for pos, types, mask in loader:
        pos, types, mask = pos.to(device), types.to(device), mask.to(device)
        loss = diffusion_loss(model, pos, types, mask, acp, T, n_types)
        tot[0] += loss * pos.shape[0]
        tot[1] += pos.shape[0]
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    full = QM9Dense(args.data)
    n_val = int(len(full) * args.val_frac)
    train_set, val_set = random_split(full, [len(full) - n_val, n_val])

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    n_types = len(ATOM_TYPES)
    model = EGNNDynamics(n_types, args.hidden, args.layers).to(device)
    ema_model = EGNNDynamics(n_types, args.hidden, args.layers).to(device)
    ema_model.load_state_dict(model.state_dict())
    ema_model.requires_grad_(False)
    ddp_model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, amsgrad=True, weight_decay=1e-12)
    acp = cosine_alphas_cumprod(args.timesteps).to(device)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        ema_model.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)

    step = start_epoch * len(train_loader)
    best = float("inf")
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for pos, types, mask in train_loader:
            pos = pos.to(device, non_blocking=True)
            types = types.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            loss = diffusion_loss(ddp_model, pos, types, mask, acp, args.timesteps, n_types)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            opt.step()
            ema_update(ema_model, model, args.ema)
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/grad_norm", gn.item(), step)

        if (epoch + 1) % args.eval_every == 0:
            val_loss = evaluate(ema_model, val_loader, acp, args.timesteps, n_types, device)
            if rank == 0:
                writer.add_scalar("val/loss_ema", val_loss, step)
                print(f"epoch {epoch} val {val_loss:.4f} ({time.time() - t0:.0f}s)", flush=True)
                if val_loss < best:
                    best = val_loss
                    torch.save({"ema": ema_model.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))

        if rank == 0:
            torch.save({"model": model.state_dict(), "ema": ema_model.state_dict(),
                        "opt": opt.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
