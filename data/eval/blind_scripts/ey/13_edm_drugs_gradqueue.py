"""EDM on GEOM-Drugs (up to 181 atoms incl. H) with EDM's adaptive gradient clipping queue.

    torchrun --nproc_per_node=8 13_edm_drugs_gradqueue.py --data /shared/geom/drugs_30conf.pt \
        --save /shared/runs/edm_drugs
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter
from torch_cluster import radius_graph

log = logging.getLogger(__name__)
N_TYPES = 16  # H B C N O F Al Si P S Cl As Br I Hg Bi


class Queue:
    def __init__(self, max_len=50):
        self.items, self.max_len = [], max_len

    def add(self, v):
        self.items.insert(0, v)
        if len(self.items) > self.max_len:
            self.items.pop()

    def mean(self):
        return float(np.mean(self.items))

    def std(self):
        return float(np.std(self.items))


class EMA:
    def __init__(self, model, beta):
        self.beta = beta
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model):
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(self.beta).add_(v, alpha=1 - self.beta)
            else:
                self.shadow[k].copy_(v)


class EquivBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.edge = nn.Sequential(nn.Linear(2 * d + 2, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU())
        self.inf = nn.Sequential(nn.Linear(d, 1), nn.Sigmoid())
        self.node = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.coord = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 1, bias=False))

    def forward(self, h, x, ei, d0):
        s, r = ei
        diff = x[s] - x[r]
        d2 = (diff ** 2).sum(-1, keepdim=True)
        m = self.edge(torch.cat([h[s], h[r], d2, d0], -1))
        m = m * self.inf(m)
        h = h + self.node(torch.cat([h, scatter(m, s, 0, dim_size=h.size(0)) / 100.0], -1))
        x = x + scatter(diff / (d2.sqrt() + 1) * torch.tanh(self.coord(m)) * 15.0, s, 0,
                        dim_size=x.size(0)) / 100.0
        return h, x


class EDMDynamics(nn.Module):
    def __init__(self, d=256, n_layers=4, cutoff=None):
        super().__init__()
        self.cutoff = cutoff
        self.h_embed = nn.Linear(N_TYPES + 1 + 1, d)  # one-hot, charge, time
        self.blocks = nn.ModuleList(EquivBlock(d) for _ in range(n_layers))
        self.h_out = nn.Linear(d, N_TYPES + 1)

    def forward(self, x, h, t, batch):
        if self.cutoff is None:
            adj = (batch[:, None] == batch[None, :]).fill_diagonal_(False)
            ei = adj.nonzero().t()
        else:
            ei = radius_graph(x, self.cutoff, batch, max_num_neighbors=128)
        d0 = ((x[ei[0]] - x[ei[1]]) ** 2).sum(-1, keepdim=True)
        z = self.h_embed(torch.cat([h, t[batch, None]], -1))
        y = x
        for blk in self.blocks:
            z, y = blk(z, y, ei, d0)
        v = y - x
        return v - scatter(v, batch, 0, reduce="mean")[batch], self.h_out(z)


def polynomial_alpha2(T, s=1e-5):
    t = np.linspace(0, T, T + 1) / T
    a2 = (1 - np.power(t, 2)) ** 2
    prec = 1 - 2 * s
    a2 = prec * a2 + s
    return torch.tensor(a2, dtype=torch.float32)


def edm_loss(model, data, a2, T):
    b = data.batch
    t = torch.randint(0, T + 1, (data.num_graphs,), device=b.device)
    at = a2[t][b, None]
    x = data.pos - scatter(data.pos, b, 0, reduce="mean")[b]
    h = torch.cat([F.one_hot(data.atom_type, N_TYPES).float() * 0.25, data.charge[:, None].float() * 0.1], -1)
    nx = torch.randn_like(x)
    nx = nx - scatter(nx, b, 0, reduce="mean")[b]
    nh = torch.randn_like(h)
    px, ph = model(at.sqrt() * x + (1 - at).sqrt() * nx, at.sqrt() * h + (1 - at).sqrt() * nh, t.float() / T, b)
    return ((px - nx) ** 2).sum(-1).mean() + ((ph - nh) ** 2).sum(-1).mean()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--n_epochs", type=int, default=13)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--diffusion_steps", type=int, default=1000)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--log_every", type=int, default=100)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    splits = torch.load(args.data, map_location="cpu")
    train_set, val_set = splits["train"], splits["val"]
    sampler = DistributedSampler(train_set, shuffle=True, seed=42, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_set[rank::world], batch_size=args.batch_size, num_workers=2)

    net = EDMDynamics().to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = EMA(net, args.ema_decay)
    eval_net = EDMDynamics().to(device).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, amsgrad=True, weight_decay=1e-12)
    a2 = polynomial_alpha2(args.diffusion_steps).to(device)
    gradnorm_queue = Queue()
    gradnorm_queue.add(3000.0)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    it_global, n_skipped = 0, 0
    for epoch in range(args.n_epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for data in loader:
            data = data.to(device, non_blocking=True)
            loss = edm_loss(model, data, a2, args.diffusion_steps)
            if not torch.isfinite(loss):
                n_skipped += 1
                log.warning("rank %d: non-finite loss at it %d, skipping batch", rank, it_global)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()

            max_norm = 1.5 * gradnorm_queue.mean() + 2 * gradnorm_queue.std()
            gnorm = float(nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm))
            if gnorm > max_norm:
                gradnorm_queue.add(max_norm)
            else:
                gradnorm_queue.add(gnorm)
            opt.step()
            ema.update(net)
            it_global += 1
            if rank == 0 and it_global % args.log_every == 0:
                log.info("ep %d it %d loss %.4f gnorm %.1f (clip %.1f)", epoch, it_global, loss.item(), gnorm,
                         max_norm)

        eval_net.load_state_dict(ema.shadow)
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for data in val_loader:
                data = data.to(device)
                tot[0] += edm_loss(eval_net, data, a2, args.diffusion_steps) * data.num_graphs
                tot[1] += data.num_graphs
        dist.all_reduce(tot)
        log.info("epoch %d done in %.0fs, val loss (EMA) %.4f, skipped %d", epoch, time.time() - t0,
                 (tot[0] / tot[1]).item(), n_skipped)

        if rank == 0:
            torch.save({"model": net.state_dict(), "ema": ema.shadow, "optimizer": opt.state_dict(),
                        "gradnorm_queue": gradnorm_queue.items, "epoch": epoch},
                       os.path.join(args.save, f"generative_model_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
