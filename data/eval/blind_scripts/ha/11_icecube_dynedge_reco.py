#!/usr/bin/env python
# DynEdge-style GNN for IceCube event reconstruction (log10 energy + direction).
# Events are pulse-level point clouds (dom_x, dom_y, dom_z, time, charge, auxiliary)
# stored as lists of torch_geometric Data in chunk files by prepare_pulses.py.
#
#   torchrun --nproc_per_node=4 11_icecube_dynedge_reco.py --data /data/icecube/pulses_pt \
#       --out runs/dynedge_e_dir --epochs 30
import argparse
import glob
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.nn import EdgeConv, knn_graph
from torch_geometric.nn import global_add_pool, global_max_pool, global_mean_pool

FEATURE_SCALE = torch.tensor([500.0, 500.0, 500.0, 3.0e4, 1.0, 1.0])
FEATURE_SHIFT = torch.tensor([0.0, 0.0, 0.0, 1.0e4, 0.0, 0.0])


class PulseChunk(torch.utils.data.Dataset):
    def __init__(self, path):
        self.events = torch.load(path, weights_only=False)

    def __len__(self):
        return len(self.events)

    def __getitem__(self, i):
        d = self.events[i].clone()
        d.x = (d.x - FEATURE_SHIFT) / FEATURE_SCALE
        d.x[:, 4] = torch.log10(d.x[:, 4].clamp(min=1e-3))
        return d


def mlp(*dims):
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.LeakyReLU()]
    return nn.Sequential(*layers)


class DynEdge(nn.Module):
    def __init__(self, n_feat=6, k=8, hidden=(128, 256), n_conv=4):
        super().__init__()
        self.k = k
        self.convs = nn.ModuleList()
        d = n_feat
        for _ in range(n_conv):
            self.convs.append(EdgeConv(mlp(2 * d, hidden[1], hidden[0]), aggr="add"))
            d = hidden[0]
        d_cat = n_feat + n_conv * hidden[0]
        self.post = mlp(d_cat, 336, hidden[1])
        self.readout = mlp(3 * hidden[1] + 1, 128, 128)
        self.energy_head = nn.Linear(128, 1)
        self.dir_head = nn.Linear(128, 4)  # (x, y, z, log kappa) for a von Mises-Fisher loss

    def forward(self, data):
        x, batch = data.x, data.batch
        feats = [x]
        edge_index = knn_graph(x[:, :3], k=self.k, batch=batch)
        for conv in self.convs:
            x = conv(x, edge_index)
            feats.append(x)
            edge_index = knn_graph(x[:, :3], k=self.k, batch=batch)
        h = self.post(torch.cat(feats, dim=1))
        n_pulses = torch.bincount(batch).float().unsqueeze(1)
        g = torch.cat([global_add_pool(h, batch), global_mean_pool(h, batch),
                       global_max_pool(h, batch), torch.log10(n_pulses)], dim=1)
        g = self.readout(g)
        d = self.dir_head(g)
        return self.energy_head(g).squeeze(-1), F.normalize(d[:, :3], dim=1), d[:, 3]


def vmf_loss(pred_dir, log_kappa, true_dir):
    kappa = log_kappa.exp().clamp(max=1e3)
    # -log C3(kappa) - kappa * cos(angle)
    logc = torch.log(kappa) - math.log(4 * math.pi) - kappa - torch.log1p(-torch.exp(-2 * kappa) + 1e-12)
    return (-logc - kappa * (pred_dir * true_dir).sum(-1)).mean()


def unit_vector(zenith, azimuth):
    return torch.stack([torch.sin(zenith) * torch.cos(azimuth), torch.sin(zenith) * torch.sin(azimuth),
                        torch.cos(zenith)], dim=1)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--n-val-chunks", type=int, default=2)
    return ap.parse_args()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    sums = torch.zeros(4, device=device)  # loss, |dlog10E|, opening angle, n
    for data in loader:
        data = data.to(device)
        e_pred, d_pred, lk = net(data)
        true_dir = unit_vector(data.zenith, data.azimuth)
        sums[0] += (F.mse_loss(e_pred, data.log10_energy, reduction="sum")
                    + vmf_loss(d_pred, lk, true_dir) * data.num_graphs)
        sums[1] += (e_pred - data.log10_energy).abs().sum()
        sums[2] += torch.arccos((d_pred * true_dir).sum(-1).clamp(-1, 1)).sum()
        sums[3] += data.num_graphs
    dist.all_reduce(sums)
    n = sums[3]
    return (sums[0] / n).item(), (sums[1] / n).item(), float(np.degrees((sums[2] / n).item()))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    chunks = sorted(glob.glob(os.path.join(args.data, "chunk_*.pt")))
    val_chunks, train_chunks = chunks[:args.n_val_chunks], chunks[args.n_val_chunks:]
    train_set = ConcatDataset([PulseChunk(c) for c in train_chunks])
    val_set = ConcatDataset([PulseChunk(c) for c in val_chunks])
    val_shard = torch.utils.data.Subset(val_set, range(rank, len(val_set), world))

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                              pin_memory=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, num_workers=4)

    model = DDP(DynEdge().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.05)
    best_path = os.path.join(args.out, "dynedge_best.pth")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, data in enumerate(train_loader):
            data = data.to(device, non_blocking=True)
            e_pred, d_pred, lk = model(data)
            loss = F.mse_loss(e_pred, data.log10_energy) + \
                vmf_loss(d_pred, lk, unit_vector(data.zenith, data.azimuth))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 500 == 0:
                print(f"[{epoch}/{it}] loss {loss.item():.4f}", flush=True)

        val_loss, e_res, ang = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f}  |dlog10E| {e_res:.3f}  "
                  f"mean opening angle {ang:.2f} deg", flush=True)
            if val_loss < best:
                best = val_loss
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    dist.destroy_process_group()

    # export the best weights together with the input scaling for the reco chain
    if rank == 0:
        net = DynEdge()
        net.load_state_dict(torch.load(best_path, map_location="cpu"))
        net.eval()
        torch.save({"state_dict": net.state_dict(), "feature_scale": FEATURE_SCALE,
                    "feature_shift": FEATURE_SHIFT}, os.path.join(args.out, "dynedge_export.pth"))
        print(f"exported {best_path} (val loss {best:.4f})")


if __name__ == "__main__":
    main()
