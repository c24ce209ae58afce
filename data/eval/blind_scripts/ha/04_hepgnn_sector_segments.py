"""Segment classifier GNN (HEP.TrkX style) on phi/eta sector graphs.

Each event is split into n_phi x n_eta sectors by the preprocessing step, one
npz per sector graph with X (hits), Ri/Ro (sparse incidence as index arrays),
y (segment labels) and pt (particle pT of each segment, -1 for fakes).

Launch:
    torchrun --nnodes=1 --nproc_per_node=8 04_hepgnn_sector_segments.py \
        --input-dir /scratch/trackml/hitgraphs_8x2 --output-dir results/segclf_8x2
"""
import argparse
import glob
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Graph:
    x: torch.Tensor
    edge_index: torch.Tensor
    y: torch.Tensor


class SectorGraphDataset(Dataset):
    def __init__(self, filenames, pt_min=1.0):
        self.filenames = filenames
        self.pt_min = pt_min

    def __len__(self):
        return len(self.filenames)

    def __getitem__(self, idx):
        with np.load(self.filenames[idx]) as f:
            x = f["X"].astype(np.float32)
            edge_index = np.stack([f["Ri_rows"], f["Ro_rows"]]).astype(np.int64)
            y = f["y"].astype(np.float32)
            pt = f["pt"].astype(np.float32)
        # segments of low-pT particles count as fakes for this training
        y = y * (pt >= self.pt_min)
        return Graph(torch.from_numpy(x), torch.from_numpy(edge_index), torch.from_numpy(y))


def collate_graphs(graphs):
    xs, eis, ys, offset = [], [], [], 0
    for g in graphs:
        xs.append(g.x)
        eis.append(g.edge_index + offset)
        ys.append(g.y)
        offset += g.x.shape[0]
    return Graph(torch.cat(xs), torch.cat(eis, dim=1), torch.cat(ys))


class EdgeNetwork(nn.Module):
    def __init__(self, in_dim, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * in_dim, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))

    def forward(self, h, edge_index):
        src, dst = edge_index
        return torch.sigmoid(self.net(torch.cat([h[src], h[dst]], dim=1))).squeeze(-1)


class NodeNetwork(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3 * in_dim, out_dim), nn.Tanh(),
                                 nn.Linear(out_dim, out_dim), nn.Tanh())

    def forward(self, h, e, edge_index):
        src, dst = edge_index
        n = h.shape[0]
        mi = torch.zeros(n, h.shape[1], device=h.device, dtype=h.dtype)
        mo = torch.zeros_like(mi)
        mi.index_add_(0, dst, e.unsqueeze(1) * h[src])
        mo.index_add_(0, src, e.unsqueeze(1) * h[dst])
        return self.net(torch.cat([mi, mo, h], dim=1))


class SegmentClassifier(nn.Module):
    def __init__(self, input_dim=3, hidden_dim=64, n_iters=4):
        super().__init__()
        self.n_iters = n_iters
        self.input_network = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.Tanh())
        self.edge_network = EdgeNetwork(input_dim + hidden_dim, hidden_dim)
        self.node_network = NodeNetwork(input_dim + hidden_dim, hidden_dim)

    def forward(self, x, edge_index):
        h = torch.cat([self.input_network(x), x], dim=-1)
        for _ in range(self.n_iters):
            e = self.edge_network(h, edge_index)
            h = torch.cat([self.node_network(h, e, edge_index), x], dim=-1)
        return self.edge_network(h, edge_index)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--input-dir", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--n-train", type=int, default=8000)
    p.add_argument("--n-valid", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--hidden-dim", type=int, default=64)
    p.add_argument("--n-iters", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=64)
    p.add_argument("--pt-min", type=float, default=1.0)
    p.add_argument("--real-weight", type=float, default=3.0)
    return p.parse_args()


def to_device(g, device):
    return Graph(g.x.to(device, non_blocking=True), g.edge_index.to(device, non_blocking=True),
                 g.y.to(device, non_blocking=True))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, n_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    filenames = sorted(glob.glob(os.path.join(args.input_dir, "event*_g*.npz")))
    train_files = filenames[:args.n_train]
    valid_files = filenames[args.n_train:args.n_train + args.n_valid]
    train_set = SectorGraphDataset(train_files, args.pt_min)
    valid_set = SectorGraphDataset(valid_files[rank::n_ranks], args.pt_min)

    train_sampler = DistributedSampler(train_set, num_replicas=n_ranks, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate_graphs, num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_set, batch_size=1, collate_fn=collate_graphs, num_workers=2)

    model = SegmentClassifier(3, args.hidden_dim, args.n_iters).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    lr_sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(os.path.join(args.output_dir, "checkpoints"), exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model parameters: {n_params}; train graphs {len(train_set)}, "
              f"valid graphs {len(valid_files)}, ranks {n_ranks}", flush=True)

    summaries = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t_start = time.time()
        sum_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = to_device(batch, device)
            if batch.y.sum() == 0:
                # sector without any true segment above pt_min
                continue
            pred = model(batch.x, batch.edge_index)
            weight = torch.where(batch.y > 0.5, args.real_weight, 1.0)
            loss = F.binary_cross_entropy(pred, batch.y, weight=weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sum_loss[0] += loss.detach()
            sum_loss[1] += 1
        lr_sched.step()
        dist.all_reduce(sum_loss)
        train_loss = (sum_loss / sum_loss[1].clamp(min=1))[0].item()

        # validation
        model.eval()
        counts = torch.zeros(5, device=device)  # loss, tp, n_pred, n_true, n_edges
        with torch.no_grad():
            for batch in valid_loader:
                batch = to_device(batch, device)
                pred = model.module(batch.x, batch.edge_index)
                counts[0] += F.binary_cross_entropy(pred, batch.y, reduction="sum")
                sel = pred > 0.5
                truth = batch.y > 0.5
                counts[1] += (sel & truth).sum()
                counts[2] += sel.sum()
                counts[3] += truth.sum()
                counts[4] += batch.y.numel()
        dist.all_reduce(counts)
        valid_loss = (counts[0] / counts[4]).item()
        purity = (counts[1] / counts[2].clamp(min=1)).item()
        efficiency = (counts[1] / counts[3].clamp(min=1)).item()

        if rank == 0:
            summary = dict(epoch=epoch, train_loss=train_loss, valid_loss=valid_loss,
                           purity=purity, efficiency=efficiency,
                           lr=optimizer.param_groups[0]["lr"], time=time.time() - t_start)
            summaries.append(summary)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in summary.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoints", f"model_checkpoint_{epoch:03d}.pth.tar"))
            np.save(os.path.join(args.output_dir, "summaries.npy"), summaries)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
