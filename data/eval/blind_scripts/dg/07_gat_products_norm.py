"""Multi-head GAT with LayerNorm and residual connections on ogbn-products.

torchrun --standalone --nproc_per_node=4 07_gat_products_norm.py --config configs/gat_products.yaml
"""
import argparse
import os
import time
from dataclasses import asdict, dataclass, field
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from ogb.nodeproppred import PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GATConv


@dataclass
class Config:
    root: str = "/data/ogb"
    hidden: int = 128
    heads: int = 4
    num_layers: int = 3
    dropout: float = 0.3
    attn_dropout: float = 0.1
    fanout: List[int] = field(default_factory=lambda: [10, 10, 10])
    batch_size: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.0
    epochs: int = 30
    grad_clip: float = 1.0
    out_dir: str = "runs/gat_products"


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--epochs", type=int, default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    if ns.epochs is not None:
        cfg.epochs = ns.epochs
    return cfg


class GAT(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels, num_layers, heads,
                 dropout, attn_dropout):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.norms = torch.nn.ModuleList()
        self.input_proj = torch.nn.Linear(in_channels, hidden * heads)
        for i in range(num_layers):
            if i == num_layers - 1:
                self.convs.append(GATConv(hidden * heads, out_channels, heads=1,
                                          concat=False, dropout=attn_dropout))
            else:
                self.convs.append(GATConv(hidden * heads, hidden, heads=heads,
                                          dropout=attn_dropout))
            self.norms.append(torch.nn.LayerNorm(hidden * heads))
        self.dropout = dropout

    def forward(self, x, edge_index):
        x = self.input_proj(x)
        for i, conv in enumerate(self.convs):
            h = conv(x, edge_index)
            if i < len(self.convs) - 1:
                h = self.norms[i](h)
                h = F.elu(h)
                h = F.dropout(h, p=self.dropout, training=self.training)
                x = x + h
            else:
                x = h
        return x


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device, dtype=torch.long)
    total = torch.zeros(1, device=device, dtype=torch.long)
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch.x, batch.edge_index)[: batch.batch_size].argmax(-1)
        y = batch.y[: batch.batch_size].view(-1)
        correct += (pred == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return correct.item() / total.item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=cfg.root)
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(asdict(cfg), f)
    dist.barrier()

    dataset = PygNodePropPredDataset("ogbn-products", root=cfg.root)
    data = dataset[0]
    split = dataset.get_idx_split()

    def my_part(idx):
        per = idx.numel() // world
        return idx[rank * per:(rank + 1) * per]

    train_loader = NeighborLoader(
        data, input_nodes=my_part(split["train"]), num_neighbors=cfg.fanout,
        batch_size=cfg.batch_size, shuffle=True, drop_last=True,
        num_workers=4, persistent_workers=True,
    )
    val_loader = NeighborLoader(
        data, input_nodes=my_part(split["valid"]), num_neighbors=cfg.fanout,
        batch_size=2048, num_workers=2,
    )

    model = GAT(dataset.num_features, cfg.hidden, dataset.num_classes,
                cfg.num_layers, cfg.heads, cfg.dropout, cfg.attn_dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total_steps = cfg.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.lr, total_steps=total_steps, pct_start=0.1
    )

    best = 0.0
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            logits = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(logits, batch.y[: batch.batch_size].view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            agg[0] += loss.detach()
            agg[1] += 1
        dist.all_reduce(agg)

        val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {agg[0].item() / agg[1].item():.4f} "
                  f"val_acc {val_acc:.4f} time {time.time() - t0:.1f}s", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch,
                            "val_acc": val_acc, "config": asdict(cfg)},
                           os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best val acc: {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
