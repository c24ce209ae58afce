"""Co-purchase link prediction on ogbn-products with GraphSAGE + MLP decoder.

Edges are split into train / val / test message-passing and supervision sets
with RandomLinkSplit; mini-batches come from LinkNeighborLoader with one
random negative per positive.

    torchrun --standalone --nproc_per_node=4 03_linkpred_products_sage.py
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from ogb.nodeproppred import PygNodePropPredDataset
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from torch_geometric import seed_everything
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv


class Encoder(torch.nn.Module):
    def __init__(self, in_channels, hidden, num_layers=2, dropout=0.3):
        super().__init__()
        self.convs = torch.nn.ModuleList(
            [SAGEConv(in_channels if i == 0 else hidden, hidden) for i in range(num_layers)]
        )
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
                x = F.dropout(x, self.dropout, training=self.training)
        return x


class LinkPredictor(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin1 = torch.nn.Linear(hidden, hidden)
        self.lin2 = torch.nn.Linear(hidden, 1)

    def forward(self, h_src, h_dst):
        z = F.relu(self.lin1(h_src * h_dst))
        return self.lin2(z).view(-1)


class Net(torch.nn.Module):
    def __init__(self, in_channels, hidden, num_layers, dropout):
        super().__init__()
        self.encoder = Encoder(in_channels, hidden, num_layers, dropout)
        self.predictor = LinkPredictor(hidden)

    def forward(self, x, edge_index, edge_label_index):
        h = self.encoder(x, edge_index)
        return self.predictor(h[edge_label_index[0]], h[edge_label_index[1]])


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--num_neighbors", default="15,10")
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--logdir", default="runs/lp_products")
    return ap.parse_args()


@torch.no_grad()
def eval_auc(model, loader, device):
    model.eval()
    preds, labels = [], []
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index, batch.edge_label_index)
        preds.append(out.sigmoid().cpu())
        labels.append(batch.edge_label.cpu())
    return roc_auc_score(torch.cat(labels).numpy(), torch.cat(preds).numpy())


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different negative samples and dropout masks on every rank
    seed_everything(args.seed + rank)

    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=args.root)
    dist.barrier()
    data = PygNodePropPredDataset("ogbn-products", root=args.root)[0]
    del data.y

    transform = T.RandomLinkSplit(
        num_val=0.01,
        num_test=0.02,
        is_undirected=True,
        add_negative_train_samples=False,
        neg_sampling_ratio=1.0,
    )
    train_data, val_data, test_data = transform(data)

    # every rank supervises an equal, disjoint slice of the training edges
    eli = train_data.edge_label_index
    per_rank = eli.size(1) // world_size
    local_eli = eli[:, rank * per_rank:(rank + 1) * per_rank]

    num_neighbors = [int(n) for n in args.num_neighbors.split(",")]
    train_loader = LinkNeighborLoader(
        train_data,
        num_neighbors=num_neighbors,
        edge_label_index=local_eli,
        neg_sampling_ratio=1.0,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=True,
    )

    model = Net(data.num_features, args.hidden, args.layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    writer = None
    if rank == 0:
        writer = SummaryWriter(args.logdir)
        val_loader = LinkNeighborLoader(
            val_data, num_neighbors=num_neighbors,
            edge_label_index=val_data.edge_label_index,
            edge_label=val_data.edge_label,
            batch_size=16384, shuffle=False, num_workers=args.workers,
        )
        test_loader = LinkNeighborLoader(
            test_data, num_neighbors=num_neighbors,
            edge_label_index=test_data.edge_label_index,
            edge_label=test_data.edge_label,
            batch_size=16384, shuffle=False, num_workers=args.workers,
        )

    best_val = 0.0
    step = 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            logits = model(batch.x, batch.edge_index, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(logits, batch.edge_label)
            loss.backward()
            optimizer.step()
            running[0] += loss.detach()
            running[1] += 1
            step += 1
        dist.all_reduce(running)
        epoch_loss = (running[0] / running[1]).item()

        if rank == 0:
            val_auc = eval_auc(model.module, val_loader, device)
            writer.add_scalar("train/loss", epoch_loss, epoch)
            writer.add_scalar("val/auc", val_auc, epoch)
            print(f"[{epoch:02d}] loss={epoch_loss:.4f} val_auc={val_auc:.4f} "
                  f"({time.time() - t0:.0f}s, {step} steps)", flush=True)
            if val_auc > best_val:
                best_val = val_auc
                torch.save(model.module.state_dict(), os.path.join(args.logdir, "best.pt"))
        dist.barrier()

    if rank == 0:
        model.module.load_state_dict(
            torch.load(os.path.join(args.logdir, "best.pt"), map_location=device)
        )
        test_auc = eval_auc(model.module, test_loader, device)
        writer.add_scalar("test/auc", test_auc, args.epochs)
        writer.close()
        print(f"best val auc {best_val:.4f} | test auc {test_auc:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
