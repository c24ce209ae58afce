"""GIN graph classifier on ogbg-molhiv with Lightning Fabric (DDP, 4 GPUs).

    python 04_fabric_gin_molhiv.py --devices 4
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from ogb.graphproppred import Evaluator, PygGraphPropPredDataset
from ogb.graphproppred.mol_encoder import AtomEncoder, BondEncoder
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.nn import MessagePassing, global_mean_pool


class GINConv(MessagePassing):
    def __init__(self, dim):
        super().__init__(aggr="add")
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.LayerNorm(2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.eps = nn.Parameter(torch.zeros(1))
        self.bond_encoder = BondEncoder(emb_dim=dim)

    def forward(self, x, edge_index, edge_attr):
        e = self.bond_encoder(edge_attr)
        return self.mlp((1 + self.eps) * x + self.propagate(edge_index, x=x, edge_attr=e))

    def message(self, x_j, edge_attr):
        return F.relu(x_j + edge_attr)


class GIN(nn.Module):
    def __init__(self, dim=300, layers=5, dropout=0.5, n_tasks=1):
        super().__init__()
        self.atom_encoder = AtomEncoder(dim)
        self.convs = nn.ModuleList([GINConv(dim) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(layers)])
        self.dropout = dropout
        self.head = nn.Linear(dim, n_tasks)

    def forward(self, data):
        h = self.atom_encoder(data.x)
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            h = norm(conv(h, data.edge_index, data.edge_attr))
            if i < len(self.convs) - 1:
                h = F.relu(h)
            h = F.dropout(h, self.dropout, training=self.training)
        return self.head(global_mean_pool(h, data.batch))


@torch.no_grad()
def evaluate(fabric, net, loader, evaluator):
    net.eval()
    ys, ps = [], []
    for batch in loader:
        batch = batch.to(fabric.device)
        ps.append(net(batch).float())
        ys.append(batch.y.float())
    net.train()
    y = torch.cat(ys) if ys else torch.empty(0, 1, device=fabric.device)
    p = torch.cat(ps) if ps else torch.empty(0, 1, device=fabric.device)
    # shards have different lengths -> pad to the longest before gathering
    n = torch.tensor([y.shape[0]], device=fabric.device)
    sizes = fabric.all_gather(n).view(-1)
    longest = int(sizes.max())
    pad = longest - y.shape[0]
    y = F.pad(y, (0, 0, 0, pad))
    p = F.pad(p, (0, 0, 0, pad))
    y_all = fabric.all_gather(y).view(-1, longest, y.shape[-1])
    p_all = fabric.all_gather(p).view(-1, longest, p.shape[-1])
    y_all = torch.cat([y_all[r, : sizes[r]] for r in range(sizes.numel())])
    p_all = torch.cat([p_all[r, : sizes[r]] for r in range(sizes.numel())])
    return evaluator.eval({"y_true": y_all.cpu(), "y_pred": p_all.cpu()})["rocauc"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32, help="per device")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="checkpoints/gin_molhiv")
    args = ap.parse_args()

    fabric = Fabric(accelerator="cuda", devices=args.devices, strategy="ddp", precision="32-true")
    fabric.launch()
    fabric.seed_everything(42 + fabric.global_rank)

    with fabric.rank_zero_first(local=True):
        dataset = PygGraphPropPredDataset("ogbg-molhiv", root=args.root)
    split = dataset.get_idx_split()
    evaluator = Evaluator("ogbg-molhiv")

    train_ds = dataset[split["train"]]
    sampler = DistributedSampler(train_ds, num_replicas=fabric.world_size, rank=fabric.global_rank,
                                 shuffle=True, seed=42)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4)
    valid_idx = split["valid"][fabric.global_rank::fabric.world_size]
    valid_loader = DataLoader(Subset(dataset, valid_idx), batch_size=256, num_workers=2)
    train_loader = fabric.setup_dataloaders(train_loader, use_distributed_sampler=False)

    torch.manual_seed(42)
    net = GIN()
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(net, optimizer)

    best, start_epoch = 0.0, 0
    ckpt_path = os.path.join(args.out, "last.ckpt")
    state = {"model": model, "optimizer": optimizer, "epoch": 0, "best": 0.0}
    if os.path.exists(ckpt_path):
        fabric.load(ckpt_path, state)
        start_epoch, best = state["epoch"] + 1, state["best"]
        fabric.print(f"resumed from epoch {state['epoch']}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, loss_sum, steps = time.time(), torch.zeros((), device=fabric.device), 0
        for batch in train_loader:
            logits = model(batch)
            mask = ~torch.isnan(batch.y)
            loss = F.binary_cross_entropy_with_logits(logits[mask], batch.y[mask].float())
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
            loss_sum += loss.detach()
            steps += 1
        mean_loss = fabric.all_reduce(loss_sum / max(steps, 1), reduce_op="mean")

        auc = evaluate(fabric, net, valid_loader, evaluator)
        fabric.print(f"epoch {epoch:3d} loss {mean_loss.item():.4f} val_rocauc {auc:.4f} "
                     f"({time.time() - t0:.0f}s)")

        state.update(epoch=epoch, best=max(best, auc))
        fabric.save(ckpt_path, state)
        if auc > best:
            best = auc
            fabric.save(os.path.join(args.out, "best.ckpt"), {"model": model, "epoch": epoch, "auc": auc})

    fabric.print(f"done, best val rocauc {best:.4f}")


if __name__ == "__main__":
    main()
