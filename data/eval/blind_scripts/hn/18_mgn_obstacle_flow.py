"""Graph network simulator (MeshGraphNet-style, PyTorch Geometric) for 2D incompressible
flow past random obstacles on unstructured meshes. Predicts the next velocity and,
optionally, other fields (pressure, passive scalar).

Preprocessed data: one .pt file per trajectory with keys
    pos [N,2], edge_index [2,E], node_type [N], velocity [T,N,2], pressure [T,N,1], scalar [T,N,1]

    torchrun --standalone --nproc_per_node=4 18_mgn_obstacle_flow.py --root /data/obstacle_flow \
        --targets velocity,pressure
"""
import argparse
import glob
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter

FIELD_DIMS = {"velocity": 2, "pressure": 1, "scalar": 1}
N_NODE_TYPES = 4  # fluid, inlet, outlet, wall


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--targets", default="velocity,pressure")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--ckpt-dir", default="ckpts/obstacle_gns")
    return p.parse_args()


class TrajectorySteps(Dataset):
    def __init__(self, files, fields, noise=0.0):
        self.trajs = [torch.load(f, map_location="cpu") for f in files]
        self.fields, self.noise = fields, noise
        self.index = [(i, t) for i, tr in enumerate(self.trajs) for t in range(tr["velocity"].shape[0] - 1)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, t = self.index[k]
        tr = self.trajs[i]
        vel = tr["velocity"][t].clone()
        fluid = tr["node_type"] == 0
        if self.noise > 0:
            vel[fluid] += self.noise * torch.randn_like(vel[fluid])
        d = Data(pos=tr["pos"], edge_index=tr["edge_index"], node_type=tr["node_type"], vel=vel)
        for name in self.fields:
            nxt = tr[name][t + 1]
            d[f"y_{name}"] = nxt - vel if name == "velocity" else nxt
        return d


def mlp(i, o, h, norm=True):
    layers = [nn.Linear(i, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, o)]
    if norm:
        layers.append(nn.LayerNorm(o))
    return nn.Sequential(*layers)


class InteractionLayer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge_fn = mlp(3 * h, h, h)
        self.node_fn = mlp(2 * h, h, h)

    def forward(self, x, e, edge_index):
        src, dst = edge_index
        e = e + self.edge_fn(torch.cat([e, x[src], x[dst]], -1))
        agg = scatter(e, dst, dim=0, dim_size=x.shape[0], reduce="sum")
        return x + self.node_fn(torch.cat([x, agg], -1)), e


class GraphSimulator(nn.Module):
    def __init__(self, target_fields, hidden, layers):
        super().__init__()
        self.node_encoder = mlp(2 + N_NODE_TYPES, hidden, hidden)
        self.edge_encoder = mlp(3, hidden, hidden)
        self.processor = nn.ModuleList([InteractionLayer(hidden) for _ in range(layers)])
        self.decoders = nn.ModuleDict({name: mlp(hidden, FIELD_DIMS[name], hidden, norm=False)
                                       for name in target_fields})

    def forward(self, data):
        rel = data.pos[data.edge_index[0]] - data.pos[data.edge_index[1]]
        e = self.edge_encoder(torch.cat([rel, rel.norm(dim=-1, keepdim=True)], -1))
        x = self.node_encoder(torch.cat([data.vel, nn.functional.one_hot(data.node_type, N_NODE_TYPES).float()], -1))
        for layer in self.processor:
            x, e = layer(x, e, data.edge_index)
        return {name: dec(x) for name, dec in self.decoders.items()}


def compute_loss(out, data):
    mask = data.node_type == 0
    losses = {name: ((pred - data[f"y_{name}"]) ** 2).sum(-1)[mask].mean() for name, pred in out.items()}
    return sum(losses.values()), losses


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    target_fields = set(args.targets.split(",")) | {"velocity"}
    train_files = sorted(glob.glob(os.path.join(args.root, "train", "*.pt")))
    valid_files = sorted(glob.glob(os.path.join(args.root, "valid", "*.pt")))
    train_ds = TrajectorySteps(train_files, target_fields, noise=args.noise)
    valid_ds = TrajectorySteps(valid_files, target_fields)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4)
    valid_idx = list(range(rank, len(valid_ds), world))
    valid_loader = DataLoader(torch.utils.data.Subset(valid_ds, valid_idx), batch_size=args.batch_size)

    model = GraphSimulator(target_fields, args.hidden, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader), eta_min=1e-6)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"targets={sorted(target_fields)} train steps={len(train_ds)} valid steps={len(valid_ds)}", flush=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device)
            loss, _ = compute_loss(model(data), data)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        names = sorted(target_fields)
        vsum = torch.zeros(len(names) + 1, device=device)
        with torch.no_grad():
            for data in valid_loader:
                data = data.to(device)
                _, parts = compute_loss(model.module(data), data)
                for j, n in enumerate(names):
                    vsum[j] += parts[n]
                vsum[-1] += 1
        dist.all_reduce(total)
        dist.all_reduce(vsum)
        if rank == 0:
            val = {n: (vsum[j] / vsum[-1]).item() for j, n in enumerate(names)}
            print(f"epoch {epoch:3d} ({time.time() - t0:.0f}s) train {(total[0] / total[1]).item():.4e} valid "
                  + " ".join(f"{n}={v:.4e}" for n, v in val.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "targets": names, "epoch": epoch}, os.path.join(args.ckpt_dir, f"epoch_{epoch:03d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
