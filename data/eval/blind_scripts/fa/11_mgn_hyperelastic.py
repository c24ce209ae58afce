"""Learned surrogate for our in-house FEM hyperelasticity runs (Neo-Hookean, tet meshes).

Each trajectory has its own adaptively refined mesh (2k - 40k nodes), so graph
sizes vary a lot between samples.  Statistics are precomputed by
prepare_hyperelastic.py into <data>/stats.json.

    torchrun --nproc_per_node=4 11_mgn_hyperelastic.py --data /project/fem_surrogate/neo_hookean \
        --save-dir /project/fem_surrogate/runs/mgn_v3
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Data, Dataset
from torch_geometric.loader import DataLoader
from torch_scatter import scatter_mean, scatter_sum

FREE, DIRICHLET, TRACTION = 0, 1, 2


class MLP(nn.Sequential):
    def __init__(self, i, o, h=128, ln=True):
        layers = [nn.Linear(i, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, o)]
        if ln:
            layers.append(nn.LayerNorm(o))
        super().__init__(*layers)


class MPLayer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge = MLP(3 * h, h)
        self.node = MLP(2 * h, h)

    def forward(self, x, e, ei):
        de = self.edge(torch.cat([x[ei[0]], x[ei[1]], e], 1))
        dx = self.node(torch.cat([x, scatter_sum(de, ei[1], 0, dim_size=x.size(0))], 1))
        return x + dx, e + de


class HyperelasticMGN(nn.Module):
    def __init__(self, stats, h=128, layers=15):
        super().__init__()
        self.register_buffer("x_mu", torch.tensor(stats["node_mean"]))
        self.register_buffer("x_sd", torch.tensor(stats["node_std"]))
        self.register_buffer("e_mu", torch.tensor(stats["edge_mean"]))
        self.register_buffer("e_sd", torch.tensor(stats["edge_std"]))
        self.register_buffer("y_mu", torch.tensor(stats["out_mean"]))
        self.register_buffer("y_sd", torch.tensor(stats["out_std"]))
        self.enc_x = MLP(len(stats["node_mean"]), h)
        self.enc_e = MLP(len(stats["edge_mean"]), h)
        self.layers = nn.ModuleList(MPLayer(h) for _ in range(layers))
        self.dec = MLP(h, len(stats["out_mean"]), ln=False)

    def forward(self, data):
        x = self.enc_x((data.x - self.x_mu) / self.x_sd)
        e = self.enc_e((data.edge_attr - self.e_mu) / self.e_sd)
        for layer in self.layers:
            x, e = layer(x, e, data.edge_index)
        return self.dec(x)


def graph_features(u, u_prev, X, bc, load, edge_index):
    """u: current displacement, X: reference coordinates, bc: node tags, load: traction increment."""
    x = torch.cat([u - u_prev, load, F.one_hot(bc, 3).float()], 1)
    s, r = edge_index
    dX, dx = X[s] - X[r], (X[s] + u[s]) - (X[r] + u[r])
    ea = torch.cat([dX, dX.norm(dim=1, keepdim=True), dx, dx.norm(dim=1, keepdim=True)], 1)
    return x, ea


class FEMSteps(Dataset):
    def __init__(self, root, split, noise=0.0):
        super().__init__()
        self.dir = os.path.join(root, split)
        self.files = sorted(f for f in os.listdir(self.dir) if f.endswith(".npz"))
        with open(os.path.join(root, f"{split}_index.json")) as f:
            self.n_steps = json.load(f)  # file name -> number of load steps
        self.items = [(f, t) for f in self.files for t in range(1, self.n_steps[f] - 1)]
        self.noise = noise

    def len(self):
        return len(self.items)

    def get(self, k):
        fname, t = self.items[k]
        z = np.load(os.path.join(self.dir, fname))
        X = torch.from_numpy(z["ref_coords"]).float()
        ei = torch.from_numpy(z["edges"]).long()
        bc = torch.from_numpy(z["node_tag"]).long()
        u_prev, u, u_next = (torch.from_numpy(z["displacement"][t + d]).float() for d in (-1, 0, 1))
        load = torch.from_numpy(z["traction"][t + 1] - z["traction"][t]).float()
        if self.noise > 0:
            n = torch.randn_like(u) * self.noise
            n[bc == DIRICHLET] = 0
            u = u + n
        x, ea = graph_features(u, u_prev, X, bc, load, ei)
        return Data(x=x, edge_index=ei, edge_attr=ea, y=u_next - u, bc=bc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-nodes", type=int, default=60_000,
                    help="batches with more nodes than this do not fit in 40GB")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--noise", type=float, default=1e-4)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lr_)

    with open(os.path.join(args.data, "stats.json")) as f:
        stats = json.load(f)

    train_ds = FEMSteps(args.data, "train", noise=args.noise)
    val_ds = FEMSteps(args.data, "valid")
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=tr_sampler, num_workers=8,
                           pin_memory=True, persistent_workers=True)
    va_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=va_sampler, num_workers=4)

    net = HyperelasticMGN(stats).to(dev)
    model = DDP(net, device_ids=[lr_])
    # lr tuned on 4 GPUs x batch 4
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * (world * args.batch_size) / 16, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"],
                                                total_steps=args.epochs * len(tr_loader))
    first_epoch = 0
    ckpt = os.path.join(args.save_dir, "last.pt")
    if args.resume and os.path.exists(ckpt):
        st = torch.load(ckpt, map_location=dev)
        net.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        first_epoch = st["epoch"] + 1
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(first_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        n_skip = 0
        for data in tr_loader:
            if data.num_nodes > args.max_nodes:
                n_skip += 1
                continue
            data = data.to(dev, non_blocking=True)
            pred = model(data)
            target = (data.y - net.y_mu) / net.y_sd
            free = data.bc != DIRICHLET
            per_graph = scatter_mean(((pred - target) ** 2).sum(1)[free], data.batch[free], dim=0)
            loss = per_graph.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()

        model.eval()
        tot = torch.zeros(2, device=dev)
        with torch.no_grad():
            for data in va_loader:
                data = data.to(dev)
                pred = net(data) * net.y_sd + net.y_mu
                free = data.bc != DIRICHLET
                tot[0] += ((pred - data.y) ** 2).sum(1)[free].sum()
                tot[1] += free.sum()
        dist.all_reduce(tot)
        skipped = torch.tensor(n_skip, device=dev)
        dist.all_reduce(skipped)
        if rank == 0:
            print(f"[epoch {epoch}] val mse {(tot[0] / tot[1]).item():.4e}  skipped {skipped.item()} batches  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
