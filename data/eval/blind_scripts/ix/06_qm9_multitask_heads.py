"""Multi-target QM9 regression: shared SchNet trunk, one readout head per property.

    torchrun --standalone --nproc_per_node=4 06_qm9_multitask_heads.py \
        --root /scratch/shared/qm9 --targets homo lumo gap mu alpha
"""
import argparse
import os
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_geometric.nn.models.schnet import GaussianSmearing, InteractionBlock, ShiftedSoftplus
from torch_scatter import scatter

# column in QM9.y, and whether the property is intensive (mean readout) or extensive (sum readout)
QM9_TARGETS = {
    "mu": (0, True), "alpha": (1, False), "homo": (2, True), "lumo": (3, True), "gap": (4, True),
    "r2": (5, False), "zpve": (6, False), "U0": (7, False), "U": (8, False), "H": (9, False),
    "G": (10, False), "cv": (11, False),
}


class MultiTaskSchNet(nn.Module):
    def __init__(self, targets, hidden=256, num_filters=256, num_interactions=6, num_gaussians=50, cutoff=5.0):
        super().__init__()
        self.cutoff = cutoff
        self.embedding = nn.Embedding(10, hidden)  # QM9 only has H, C, N, O, F
        self.distance_expansion = GaussianSmearing(0.0, cutoff, num_gaussians)
        self.interactions = nn.ModuleList(
            [InteractionBlock(hidden, num_gaussians, num_filters, cutoff) for _ in range(num_interactions)]
        )
        self.heads = nn.ModuleDict()
        for name in set(targets):
            self.heads[name] = nn.Sequential(nn.Linear(hidden, hidden // 2), ShiftedSoftplus(), nn.Linear(hidden // 2, 1))

    def forward(self, z, pos, batch):
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=32)
        row, col = edge_index
        edge_weight = (pos[row] - pos[col]).norm(dim=-1)
        edge_attr = self.distance_expansion(edge_weight)
        h = self.embedding(z)
        for block in self.interactions:
            h = h + block(h, edge_index, edge_weight, edge_attr)
        out = {}
        for name, head in self.heads.items():
            intensive = QM9_TARGETS[name][1]
            out[name] = scatter(head(h).squeeze(-1), batch, dim=0, reduce="mean" if intensive else "sum")
        return out


def load_qm9(root, rank):
    # only rank 0 may run PyG's processing step; the others wait and then read the processed file
    if rank == 0:
        ds = QM9(root)
    dist.barrier()
    if rank != 0:
        ds = QM9(root)
    return ds


@torch.no_grad()
def evaluate(model, loader, targets, stats, device):
    model.eval()
    sums = torch.zeros(len(targets) + 1, device=device, dtype=torch.float64)
    for data in loader:
        data = data.to(device)
        out = model(data.z, data.pos, data.batch)
        for k, name in enumerate(targets):
            col = QM9_TARGETS[name][0]
            pred = out[name] * stats[name][1] + stats[name][0]
            sums[k] += (pred - data.y[:, col]).abs().sum()
        sums[-1] += data.num_graphs
    dist.all_reduce(sums)
    return {name: (sums[k] / sums[-1]).item() for k, name in enumerate(targets)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/scratch/shared/qm9")
    ap.add_argument("--targets", nargs="+", default=["homo", "lumo", "gap"])
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup_epochs", type=int, default=5)
    ap.add_argument("--save_dir", default="checkpoints/qm9_mt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    dataset = load_qm9(args.root, rank)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(dataset), generator=g).tolist()
    train_idx, val_idx = perm[:110000], perm[110000:120000]
    train_set = Subset(dataset, train_idx)
    val_set = Subset(dataset, val_idx[rank::world])

    # normalisation from the training targets (identical on every rank)
    y_train = dataset.y[train_idx]
    stats = {}
    for name in args.targets:
        col = QM9_TARGETS[name][0]
        stats[name] = (y_train[:, col].mean().item(), y_train[:, col].std().item())

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=256, num_workers=2)

    model = MultiTaskSchNet(args.targets).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps_per_epoch = len(train_loader)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=args.warmup_epochs * steps_per_epoch)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=(args.epochs - args.warmup_epochs) * steps_per_epoch)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[args.warmup_epochs * steps_per_epoch])

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = defaultdict(float)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            out = model(data.z, data.pos, data.batch)
            loss = 0.0
            for name in args.targets:
                mean, std = stats[name]
                target = (data.y[:, QM9_TARGETS[name][0]] - mean) / std
                l = (out[name] - target).abs().mean()
                running[name] += l.item()
                loss = loss + l
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()

        val = evaluate(model, val_loader, args.targets, stats, device)
        # sum of normalised MAEs decides the best checkpoint
        score = sum(val[name] / stats[name][1] for name in args.targets)
        if rank == 0:
            train_str = " ".join(f"{k}={v / steps_per_epoch:.3f}" for k, v in running.items())
            val_str = " ".join(f"{k}={v:.4f}" for k, v in val.items())
            print(f"epoch {epoch} | train(norm) {train_str} | val MAE {val_str}", flush=True)
            state = {"model": model.module.state_dict(), "stats": stats, "targets": args.targets, "epoch": epoch}
            torch.save(state, os.path.join(args.save_dir, "last.pt"))
            if score < best:
                best = score
                torch.save(state, os.path.join(args.save_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
