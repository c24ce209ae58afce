"""EDM on GEOM-Drugs conformers (PyG, radius graphs) with atom/molecule stability eval.

Run:
    torchrun --standalone --nproc_per_node=8 04_edm_geom_stability.py --config configs/geom_edm.yaml
"""
import argparse
import os
import math
from dataclasses import dataclass, field, asdict

import yaml
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter
from torch_cluster import radius_graph

ELEMENTS = ["H", "B", "C", "N", "O", "F", "Al", "Si", "P", "S", "Cl", "As", "Br", "I", "Hg", "Bi"]
COV_RADIUS = {"H": 0.31, "B": 0.84, "C": 0.76, "N": 0.71, "O": 0.66, "F": 0.57, "Al": 1.21, "Si": 1.11,
              "P": 1.07, "S": 1.05, "Cl": 1.02, "As": 1.19, "Br": 1.20, "I": 1.39, "Hg": 1.32, "Bi": 1.48}
MAX_VALENCE = {"H": 1, "B": 3, "C": 4, "N": 3, "O": 2, "F": 1, "Al": 3, "Si": 4,
               "P": 5, "S": 6, "Cl": 1, "As": 3, "Br": 1, "I": 1, "Hg": 2, "Bi": 3}


@dataclass
class Cfg:
    data_path: str = "data/geom_drugs_30.pt"
    out_dir: str = "outputs/geom_edm"
    epochs: int = 300
    batch_size: int = 32
    lr: float = 1e-4
    hidden: int = 256
    n_layers: int = 4
    cutoff: float = 5.0
    timesteps: int = 1000
    ema_decay: float = 0.9999
    n_samples: int = 512
    sample_batch: int = 64
    eval_every: int = 10
    seed: int = 0
    extra: dict = field(default_factory=dict)


class EGCL(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge = nn.Sequential(nn.Linear(2 * h + 1, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU())
        self.att = nn.Sequential(nn.Linear(h, 1), nn.Sigmoid())
        self.node = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))
        self.coord = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1, bias=False))
        self.ln = nn.LayerNorm(h)

    def forward(self, h, x, ei):
        src, dst = ei
        rel = x[src] - x[dst]
        d = rel.norm(dim=-1, keepdim=True)
        m = self.edge(torch.cat([h[src], h[dst], d ** 2], -1))
        m = m * self.att(m)
        agg = scatter(m, src, 0, dim_size=h.size(0), reduce="sum")
        h = self.ln(h + self.node(torch.cat([h, agg], -1)))
        x = x + scatter(rel / (d + 1.0) * torch.tanh(self.coord(m)) * 15.0, src, 0, dim_size=x.size(0), reduce="mean")
        return h, x


class Denoiser(nn.Module):
    def __init__(self, n_types, hidden, n_layers, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.n_types = n_types
        self.emb = nn.Linear(n_types + 1, hidden)
        self.layers = nn.ModuleList(EGCL(hidden) for _ in range(n_layers))
        self.head = nn.Linear(hidden, n_types)

    def forward(self, x, h, t, batch):
        ei = radius_graph(x, r=self.cutoff, batch=batch, max_num_neighbors=64)
        z = self.emb(torch.cat([h, t[batch, None]], -1))
        xx = x
        for layer in self.layers:
            z, xx = layer(z, xx, ei)
        dx = xx - x
        dx = dx - scatter(dx, batch, 0, reduce="mean")[batch]
        return dx, self.head(z)


def alpha_bar(T, device):
    t = torch.linspace(0, 1, T + 1, device=device)
    return ((1 - 2e-5) * (1 - t ** 2) ** 2 + 1e-5)


def zero_com(x, batch):
    return x - scatter(x, batch, 0, reduce="mean")[batch]


def training_loss(model, data, ab, T):
    n_graph = data.num_graphs
    t = torch.randint(0, T + 1, (n_graph,), device=data.pos.device)
    a = ab[t][data.batch].unsqueeze(-1)
    x0 = zero_com(data.pos, data.batch)
    h0 = data.x.float() * 0.25
    nx, nh = zero_com(torch.randn_like(x0), data.batch), torch.randn_like(h0)
    px, ph = model(a.sqrt() * x0 + (1 - a).sqrt() * nx, a.sqrt() * h0 + (1 - a).sqrt() * nh, t.float() / T, data.batch)
    return ((px - nx) ** 2).sum(-1).mean() + ((ph - nh) ** 2).sum(-1).mean()


@torch.no_grad()
def generate(model, n_nodes, ab, T, device):
    batch = torch.repeat_interleave(torch.arange(len(n_nodes), device=device), n_nodes)
    x = zero_com(torch.randn(batch.numel(), 3, device=device), batch)
    h = torch.randn(batch.numel(), model.n_types, device=device)
    for s in reversed(range(1, T + 1)):
        a_t, a_s = ab[s], ab[s - 1]
        px, ph = model(x, h, torch.full((len(n_nodes),), s / T, device=device), batch)
        ratio = a_t / a_s
        coef = (1 - ratio) / (1 - a_t).sqrt()
        x = (x - coef * px) / ratio.sqrt()
        h = (h - coef * ph) / ratio.sqrt()
        if s > 1:
            std = ((1 - ratio) * (1 - a_s) / (1 - a_t)).sqrt()
            x = x + std * zero_com(torch.randn_like(x), batch)
            h = h + std * torch.randn_like(h)
    return x, h.argmax(-1), batch


def stability(x, types, batch):
    """EDM-style stability with a distance-only bond heuristic."""
    n_stable_atoms, n_atoms, n_stable_mols, n_mols = 0, 0, 0, 0
    for g in batch.unique():
        sel = batch == g
        pos, el = x[sel].cpu(), [ELEMENTS[i] for i in types[sel].tolist()]
        d = torch.cdist(pos, pos)
        rad = torch.tensor([COV_RADIUS[e] for e in el])
        bonded = (d < (rad[:, None] + rad[None, :]) * 1.15) & ~torch.eye(len(el), dtype=torch.bool)
        deg = bonded.sum(1)
        ok = torch.tensor([deg[i].item() <= MAX_VALENCE[e] and deg[i].item() > 0 for i, e in enumerate(el)])
        n_stable_atoms += int(ok.sum())
        n_atoms += len(el)
        n_stable_mols += int(ok.all())
        n_mols += 1
    return n_stable_atoms, n_atoms, n_stable_mols, n_mols


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = Cfg()
    if cli.config:
        with open(cli.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + rank)

    dataset = torch.load(cfg.data_path)  # list of torch_geometric Data, one-hot in .x
    n_val = len(dataset) // 20
    g = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(len(dataset), generator=g).tolist()
    train_set = [dataset[i] for i in perm[n_val:]]
    size_hist = torch.bincount(torch.tensor([d.num_nodes for d in train_set])).float()

    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    net = Denoiser(len(ELEMENTS), cfg.hidden, cfg.n_layers, cfg.cutoff).to(dev)
    model = DDP(net, device_ids=[local_rank])
    ema = Denoiser(len(ELEMENTS), cfg.hidden, cfg.n_layers, cfg.cutoff).to(dev)
    ema.load_state_dict(net.state_dict())
    ema.requires_grad_(False).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-12, amsgrad=True)
    ab = alpha_bar(cfg.timesteps, dev)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(asdict(cfg), f)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, data in enumerate(loader):
            data = data.to(dev)
            loss = training_loss(model, data, ab, cfg.timesteps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.mul_(cfg.ema_decay).add_(p, alpha=1 - cfg.ema_decay)
            if rank == 0 and it % 200 == 0:
                print(f"[ep {epoch} it {it}] loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % cfg.eval_every == 0:
            n_local = math.ceil(cfg.n_samples / world)
            totals = [0, 0, 0, 0]
            for start in range(0, n_local, cfg.sample_batch):
                k = min(cfg.sample_batch, n_local - start)
                n_nodes = torch.multinomial(size_hist, k, replacement=True).to(dev)
                x, types, batch = generate(ema, n_nodes, ab, cfg.timesteps, dev)
                for j, v in enumerate(stability(x, types, batch)):
                    totals[j] += v
            counts = torch.tensor(totals, dtype=torch.float64)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            if rank == 0:
                print(f"epoch {epoch}: atom_stable {counts[0] / counts[1]:.4f} "
                      f"mol_stable {counts[2] / counts[3]:.4f}", flush=True)

        if rank == 0:
            torch.save({"model": net.state_dict(), "ema": ema.state_dict(), "optimizer": opt.state_dict(),
                        "epoch": epoch, "cfg": asdict(cfg)}, os.path.join(cfg.out_dir, "last.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
