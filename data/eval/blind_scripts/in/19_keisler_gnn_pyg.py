"""Keisler (2022)-style GNN: grid -> icosahedral mesh -> grid, 6 h step, trained on a 3-step rollout
and scored on 1-5 day forecasts.

    torchrun --nproc_per_node=8 19_keisler_gnn_pyg.py --config cfg/keisler_1deg.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import MessagePassing


class Era5Window(Dataset):
    def __init__(self, root, years, length, mean, std, init_stride=1):
        self.arrs = [np.load(f"{root}/{y}.npy", mmap_mode="r") for y in years]     # (T, C, 181, 360)
        self.items = [(k, t) for k, a in enumerate(self.arrs)
                      for t in range(0, a.shape[0] - length, init_stride)]
        self.length = length
        self.mean, self.std = mean[:, None, None], std[:, None, None]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        k, t = self.items[i]
        seq = np.asarray(self.arrs[k][t:t + self.length + 1], dtype=np.float32)
        seq = (seq - self.mean) / self.std
        return torch.from_numpy(seq.reshape(self.length + 1, seq.shape[1], -1).transpose(0, 2, 1).copy())


class EdgeNodeMP(MessagePassing):
    def __init__(self, dim):
        super().__init__(aggr="sum")
        self.edge_mlp = nn.Sequential(nn.Linear(3 * dim, dim), nn.SiLU(), nn.Linear(dim, dim), nn.LayerNorm(dim))
        self.node_mlp = nn.Sequential(nn.Linear(2 * dim, dim), nn.SiLU(), nn.Linear(dim, dim), nn.LayerNorm(dim))

    def forward(self, x, edge_index, edge_attr, size=None):
        x_src, x_dst = x if isinstance(x, tuple) else (x, x)
        agg = self.propagate(edge_index, x=(x_src, x_dst), edge_attr=edge_attr, size=size)
        return x_dst + self.node_mlp(torch.cat([x_dst, agg], dim=-1))

    def message(self, x_i, x_j, edge_attr):
        return self.edge_mlp(torch.cat([x_i, x_j, edge_attr], dim=-1))


class KeislerGNN(nn.Module):
    def __init__(self, graph, n_vars, dim=256, n_mp=9):
        super().__init__()
        self.n_grid, self.n_mesh = graph["n_grid"], graph["n_mesh"]
        self.register_buffer("g2m", graph["g2m_index"], persistent=False)
        self.register_buffer("mm", graph["mesh_index"], persistent=False)
        self.register_buffer("m2g", graph["m2g_index"], persistent=False)
        self.register_buffer("g2m_attr", graph["g2m_attr"], persistent=False)
        self.register_buffer("mm_attr", graph["mesh_attr"], persistent=False)
        self.register_buffer("m2g_attr", graph["m2g_attr"], persistent=False)
        self.register_buffer("grid_feat", graph["grid_feat"], persistent=False)
        self.register_buffer("mesh_feat", graph["mesh_feat"], persistent=False)
        ea = self.g2m_attr.shape[-1]
        self.grid_in = nn.Linear(n_vars + self.grid_feat.shape[-1], dim)
        self.mesh_in = nn.Linear(self.mesh_feat.shape[-1], dim)
        self.e_g2m, self.e_mm, self.e_m2g = nn.Linear(ea, dim), nn.Linear(ea, dim), nn.Linear(ea, dim)
        self.enc = EdgeNodeMP(dim)
        self.proc = nn.ModuleList([EdgeNodeMP(dim) for _ in range(n_mp)])
        self.dec = EdgeNodeMP(dim)
        self.out = nn.Linear(dim, n_vars)

    def step(self, x):
        # x: (N_grid, C) for one sample; PyG message passing works on a flat node dimension
        g = self.grid_in(torch.cat([x, self.grid_feat], dim=-1))
        m = self.mesh_in(self.mesh_feat)
        m = self.enc((g, m), self.g2m, self.e_g2m(self.g2m_attr), size=(self.n_grid, self.n_mesh))
        e = self.e_mm(self.mm_attr)
        for layer in self.proc:
            m = layer(m, self.mm, e)
        g = self.dec((m, g), self.m2g, self.e_m2g(self.m2g_attr), size=(self.n_mesh, self.n_grid))
        return x + self.out(g)

    def forward(self, x):
        return torch.stack([self.step(xi) for xi in x])

    @torch.no_grad()
    def forecast(self, x, n_steps):
        out = []
        for _ in range(n_steps):
            x = self(x)
            out.append(x)
        return torch.stack(out, dim=1)


def node_lat_weights(lat_deg, device):
    w = torch.cos(torch.deg2rad(torch.as_tensor(lat_deg, dtype=torch.float32, device=device)))
    return (w / w.mean()).view(1, -1, 1)


@torch.no_grad()
def evaluate(model, loader, w, std, n_steps, channels, device):
    model.eval()
    acc = torch.zeros(n_steps, len(channels), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for seq in loader:
        seq = seq.to(device, non_blocking=True)
        preds = model.forecast(seq[:, 0], n_steps)
        err = ((preds - seq[:, 1:]) * std) ** 2                 # (B, steps, N, C)
        rmse = (err * w.unsqueeze(1)).mean(dim=2).sqrt()          # (B, steps, C)
        acc += rmse[..., channels].sum(0).double()
        count += seq.shape[0]
    dist.all_reduce(acc)
    dist.all_reduce(count)
    model.train()
    return (acc / count).cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = np.load(cfg["norm_file"])
    mean, std = norm["mean"].astype(np.float32), norm["std"].astype(np.float32)
    graph = torch.load(cfg["graph_file"], map_location="cpu")
    train_ds = Era5Window(cfg["data_root"], range(1979, 2016), cfg["train_rollout"], mean, std)
    val_full = Era5Window(cfg["data_root"], [2016, 2017], cfg["eval_steps"], mean, std, init_stride=8)
    val_ds = Subset(val_full, list(range(rank, len(val_full), world)))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_per_gpu"], num_workers=4, pin_memory=True)

    net = KeislerGNN(graph, len(mean), cfg["hidden"], cfg["mp_steps"]).to(device)
    # the only buffers are the fixed graph tensors; nothing to broadcast
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)
    lr = cfg["lr"] * cfg["batch_per_gpu"] * world / cfg["ref_batch"]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    total = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg["warmup"]) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    w = node_lat_weights(graph["grid_lat"], device)
    std_t = torch.from_numpy(std).to(device).view(1, 1, 1, -1)
    score_ch = [cfg["channels"].index(c) for c in ("z500", "t850", "t2m")]
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, seq in enumerate(train_dl):
            seq = seq.to(device, non_blocking=True)
            x, loss = seq[:, 0], 0.0
            for k in range(cfg["train_rollout"]):
                x = model(x)
                loss = loss + ((x - seq[:, k + 1]) ** 2 * w).mean()
            loss = loss / cfg["train_rollout"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        rmse = evaluate(model, val_dl, w, std_t, cfg["eval_steps"], score_ch, device)
        if rank == 0:
            for day in range(1, cfg["eval_steps"] // 4 + 1):
                k = 4 * day - 1
                print(f"  day {day}: z500 {rmse[k, 0]:.1f} t850 {rmse[k, 1]:.2f} t2m {rmse[k, 2]:.2f}")
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], f"keisler_ep{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
