"""Next-segment prediction with a road-network GNN over the full Beijing graph.

The OSM drive network of Beijing (~310k directed segments) is encoded with a
K-hop propagation (one GCN layer whose weights are shared across hops, as in
APPNP/SGC-style encoders) on every step, so activations of all hops are kept
per step. Hops are recomputed in the backward pass to fit the graph on one GPU.
Trajectories (map-matched T-Drive + DiDi) are decoded with a GRU that scores
the out-neighbours of the current segment only.

    torchrun --nproc_per_node=8 14_beijing_roadgnn_nextseg_ckpt.py --hops 8
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import GCNConv
from torch_geometric.utils import to_undirected


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", default="/data/roadnet/beijing_osm_drive.pt")
    ap.add_argument("--trajs", default="/data/roadnet/beijing_mm_paths.npz")
    ap.add_argument("--out_dir", default="checkpoints/bj_roadgnn")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hops", type=int, default=8)
    ap.add_argument("--max_deg", type=int, default=8)
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=21)
    return ap.parse_args()


class PathDataset(Dataset):
    def __init__(self, paths, max_len):
        self.paths, self.max_len = paths, max_len

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        p = self.paths[i][: self.max_len + 1]
        x = np.full(self.max_len + 1, -1, np.int64)
        x[: len(p)] = p
        return torch.from_numpy(x)


class SharedHopEncoder(nn.Module):
    def __init__(self, dim, hops):
        super().__init__()
        self.hops = hops
        self.conv = GCNConv(dim, dim, add_self_loops=True, normalize=True)
        self.norm = nn.LayerNorm(dim)

    def _hop(self, h, edge_index):
        return self.norm(h + F.gelu(self.conv(h, edge_index)))

    def forward(self, h, edge_index):
        for _ in range(self.hops):
            h = checkpoint(self._hop, h, edge_index, use_reentrant=True)
        return h


class RoadNextSeg(nn.Module):
    def __init__(self, n_seg, feat_dim, dim, hops):
        super().__init__()
        self.feat = nn.Linear(feat_dim, dim)
        self.seg = nn.Embedding(n_seg, dim)
        self.gnn = SharedHopEncoder(dim, hops)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.q = nn.Linear(dim, dim)

    def forward(self, x_feat, edge_index, cur, nbrs):
        """cur: (B, T) current segment ids; nbrs: (B, T, D) candidate next segments (-1 = none)."""
        road = self.gnn(self.feat(x_feat) + self.seg.weight, edge_index)
        h, _ = self.gru(road[cur])
        cand = road[nbrs.clamp(min=0)]  # (B, T, D, dim)
        scores = torch.einsum("btd,btkd->btk", self.q(h), cand)
        return scores.masked_fill(nbrs < 0, -1e4)


def build_out_neighbours(directed_edge_index, n_seg, max_deg):
    nbr = np.full((n_seg, max_deg), -1, np.int64)
    fill = np.zeros(n_seg, np.int64)
    for s, t in directed_edge_index.t().tolist():
        if fill[s] < max_deg:
            nbr[s, fill[s]] = t
            fill[s] += 1
    return torch.from_numpy(nbr)


def targets_from_paths(paths, nbr_table):
    cur, nxt = paths[:, :-1], paths[:, 1:]
    valid = (cur >= 0) & (nxt >= 0)
    nbrs = nbr_table[cur.clamp(min=0)]  # (B, T, D)
    hit = nbrs.eq(nxt[..., None])
    target = hit.float().argmax(-1)
    valid &= hit.any(-1)
    target[~valid] = -100
    return cur.clamp(min=0), nbrs, target


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    g = torch.load(args.graph, map_location="cpu", weights_only=False)  # x: (N, F), edge_index: line graph
    n_seg = g.num_nodes
    nbr_table = build_out_neighbours(g.edge_index, n_seg, args.max_deg).to(device)
    x_feat = g.x.float().to(device)
    ei = to_undirected(g.edge_index, num_nodes=n_seg).to(device)

    z = np.load(args.trajs, allow_pickle=True)
    train_ds = PathDataset(list(z["train"]), args.max_len)
    val_ds = PathDataset(list(z["val"]), args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128, num_workers=2)

    net = RoadNextSeg(n_seg, x_feat.size(1), args.dim, args.hops).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"segments={n_seg} edges={ei.size(1)} train={len(train_ds)} val={len(val_ds)}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for it, paths in enumerate(train_dl):
            cur, nbrs, target = targets_from_paths(paths.to(device, non_blocking=True), nbr_table)
            scores = model(x_feat, ei, cur, nbrs)
            loss = F.cross_entropy(scores.flatten(0, 1), target.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and it % 100 == 0:
                mem = torch.cuda.max_memory_allocated(device) / 2**30
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} mem {mem:.1f}G", flush=True)
        dist.all_reduce(meter)

        net.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for paths in val_dl:
                cur, nbrs, target = targets_from_paths(paths.to(device), nbr_table)
                pred = net(x_feat, ei, cur, nbrs).argmax(-1)
                m = target != -100
                acc += torch.stack([(pred[m] == target[m]).sum().float(), m.sum().float()])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(meter[0] / meter[1]).item():.4f} val next-seg acc "
                  f"{(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch},
                       os.path.join(args.out_dir, f"epoch{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
