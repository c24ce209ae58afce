"""GraphCast-lite: encode-process-decode GNN on a refined icosahedral mesh.

Grid nodes are the 1.0 deg ERA5 lat-lon points; the mesh and the grid2mesh /
mesh2grid edges are precomputed by build_graph.py and stored in graph.npz.
Training uses a short autoregressive rollout (loss summed over the steps).
"""
import argparse
import json
import os
import time
from dataclasses import dataclass, field, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    data_dir: str = "/lustre/era5/1p0deg"
    graph_path: str = "/lustre/era5/graphs/mesh_r5_1p0deg.npz"
    stats_path: str = "/lustre/era5/1p0deg/stats_1979_2015.nc"
    train_years: tuple = tuple(range(1979, 2016))
    valid_years: tuple = (2017,)
    latent: int = 256
    processor_layers: int = 12
    rollout_steps: int = 2
    batch_size: int = 1
    lr: float = 1e-3
    epochs: int = 30
    num_workers: int = 6
    out_dir: str = "/lustre/users/wx/graphcast_lite"
    variables: list = field(default_factory=lambda: ["z500", "t850", "t2m", "u10", "v10", "msl", "q700"])


class TimeWindowDataset(Dataset):
    """Returns a window [t, t+1, ..., t+rollout] of states, flattened to (steps, nodes, channels)."""

    def __init__(self, cfg, years, mean, std):
        files = [os.path.join(cfg.data_dir, f"era5_{y}.nc") for y in years]
        ds = xr.open_mfdataset(files, combine="by_coords", parallel=False)
        self.da = ds[cfg.variables].to_array("channel").transpose("time", "lat", "lon", "channel")
        self.window = cfg.rollout_steps + 1
        self.mean = mean.astype(np.float32)
        self.std = std.astype(np.float32)

    def __len__(self):
        return self.da.sizes["time"] - self.window + 1

    def __getitem__(self, i):
        w = self.da.isel(time=slice(i, i + self.window)).values.astype(np.float32)
        w = (w - self.mean) / self.std
        return torch.from_numpy(w.reshape(self.window, -1, w.shape[-1]))


def mlp(din, dout, hidden):
    return nn.Sequential(nn.Linear(din, hidden), nn.SiLU(), nn.Linear(hidden, dout), nn.LayerNorm(dout))


class InteractionLayer(nn.Module):
    def __init__(self, latent):
        super().__init__()
        self.edge_mlp = mlp(3 * latent, latent, latent)
        self.node_mlp = mlp(2 * latent, latent, latent)

    def forward(self, src_h, dst_h, edge_h, src, dst):
        e = self.edge_mlp(torch.cat([edge_h, src_h[:, src], dst_h[:, dst]], dim=-1))
        agg = torch.zeros_like(dst_h).index_add_(1, dst, e)
        dst_new = dst_h + self.node_mlp(torch.cat([dst_h, agg], dim=-1))
        return dst_new, edge_h + e


class GraphCastLite(nn.Module):
    def __init__(self, n_vars, n_static, graph, latent=256, n_layers=12):
        super().__init__()
        for k in ("g2m_src", "g2m_dst", "m2m_src", "m2m_dst", "m2g_src", "m2g_dst"):
            self.register_buffer(k, torch.as_tensor(graph[k], dtype=torch.long), persistent=False)
        for k in ("g2m_feat", "m2m_feat", "m2g_feat", "mesh_feat", "grid_static"):
            self.register_buffer(k, torch.as_tensor(graph[k], dtype=torch.float32), persistent=False)
        self.n_mesh = int(graph["mesh_feat"].shape[0])
        self.grid_embed = mlp(n_vars + n_static, latent, latent)
        self.mesh_embed = mlp(self.mesh_feat.shape[-1], latent, latent)
        self.g2m_embed = mlp(self.g2m_feat.shape[-1], latent, latent)
        self.m2m_embed = mlp(self.m2m_feat.shape[-1], latent, latent)
        self.m2g_embed = mlp(self.m2g_feat.shape[-1], latent, latent)
        self.encoder = InteractionLayer(latent)
        self.processor = nn.ModuleList([InteractionLayer(latent) for _ in range(n_layers)])
        self.decoder = InteractionLayer(latent)
        self.out = nn.Sequential(nn.Linear(latent, latent), nn.SiLU(), nn.Linear(latent, n_vars))

    def forward(self, x):
        # x: (B, n_grid, n_vars) normalised state; predicts the residual to the next step
        B = x.shape[0]
        static = self.grid_static.unsqueeze(0).expand(B, -1, -1)
        g = self.grid_embed(torch.cat([x, static], dim=-1))
        m = self.mesh_embed(self.mesh_feat).unsqueeze(0).expand(B, -1, -1)
        e = self.g2m_embed(self.g2m_feat).unsqueeze(0).expand(B, -1, -1)
        m, _ = self.encoder(g, m, e, self.g2m_src, self.g2m_dst)
        e = self.m2m_embed(self.m2m_feat).unsqueeze(0).expand(B, -1, -1)
        for layer in self.processor:
            m, e = layer(m, m, e, self.m2m_src, self.m2m_dst)
        e = self.m2g_embed(self.m2g_feat).unsqueeze(0).expand(B, -1, -1)
        g, _ = self.decoder(m, g, e, self.m2g_src, self.m2g_dst)
        return x + self.out(g)


def weighted_mse(pred, target, w):
    # w: (n_grid,) cos(lat) area weights, mean 1
    return ((pred - target) ** 2 * w[None, :, None]).mean()


@torch.no_grad()
def evaluate(net, loader, w, std, device, steps):
    net.eval()
    sse = torch.zeros(steps, std.numel(), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    for win in loader:
        win = win.to(device, non_blocking=True)
        state = win[:, 0]
        for s in range(steps):
            state = net(state)
            err = ((state - win[:, s + 1]) * std) ** 2 * w[None, :, None]
            sse[s] += err.mean(dim=1).sum(0).double()
        count += win.shape[0]
    dist.all_reduce(sse)
    dist.all_reduce(count)
    return torch.sqrt(sse / count).cpu()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cfg", type=str, default=None, help="json overrides")
    p.add_argument("--eval_steps", type=int, default=8)
    a = p.parse_args()
    cfg = Config()
    if a.cfg:
        with open(a.cfg) as f:
            for k, v in json.load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    stats = xr.open_dataset(cfg.stats_path)
    mean = np.stack([stats[v].sel(stat="mean").values for v in cfg.variables])
    std = np.stack([stats[v].sel(stat="std").values for v in cfg.variables])
    graph = dict(np.load(cfg.graph_path))
    area_w = torch.as_tensor(graph["grid_area_weight"], dtype=torch.float32, device=device)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=device)

    train_ds = TimeWindowDataset(cfg, cfg.train_years, mean, std)
    eval_cfg = Config(**{**asdict(cfg), "rollout_steps": a.eval_steps})
    valid_ds = TimeWindowDataset(eval_cfg, cfg.valid_years, mean, std)
    # 12-hourly initialisations for validation, as in WeatherBench; strided over ranks
    # without padding so that every initialisation is scored exactly once
    inits = list(range(0, len(valid_ds), 2))
    valid_ds = torch.utils.data.Subset(valid_ds, inits[rank::dist.get_world_size()])

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.num_workers, pin_memory=True, prefetch_factor=4,
                              persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=1, shuffle=False, num_workers=2, pin_memory=True)

    net = GraphCastLite(len(cfg.variables), graph["grid_static"].shape[-1], graph,
                        latent=cfg.latent, n_layers=cfg.processor_layers).to(device)
    net = DDP(net, device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = cfg.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total_steps, pct_start=0.02)

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    gstep = 0
    for epoch in range(cfg.epochs):
        net.train()
        t0 = time.time()
        for win in train_loader:
            win = win.to(device, non_blocking=True)
            state = win[:, 0]
            loss = 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for s in range(cfg.rollout_steps):
                    state = net(state)
                    loss = loss + weighted_mse(state.float(), win[:, s + 1], area_w)
            loss = loss / cfg.rollout_steps
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 32.0)
            opt.step()
            sched.step()
            gstep += 1
            if writer is not None and gstep % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), gstep)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], gstep)

        rmse = evaluate(net.module, valid_loader, area_w, std_t, device, a.eval_steps)
        if rank == 0:
            for vi, v in enumerate(cfg.variables):
                writer.add_scalar(f"valid/rmse_{v}_24h", rmse[3, vi].item(), epoch)
                writer.add_scalar(f"valid/rmse_{v}_48h", rmse[7, vi].item(), epoch)
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s  z500@48h={rmse[7, 0]:.1f}", flush=True)
            torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "cfg": asdict(cfg)},
                       os.path.join(cfg.out_dir, f"ckpt_{epoch:03d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
