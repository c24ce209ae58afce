"""GraphSAGE + NeighborLoader on ogbn-arxiv, DDP training, test on the best epoch.

    torchrun --standalone --nproc_per_node=2 19_arxiv_sage_neighbor_ddp.py
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv

log = logging.getLogger(__name__)


class SAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels, num_layers=3, dropout=0.5):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.norms = torch.nn.ModuleList()
        dims = [in_channels] + [hidden] * (num_layers - 1)
        for d_in in dims:
            self.convs.append(SAGEConv(d_in, hidden))
            self.norms.append(torch.nn.LayerNorm(hidden))
        self.head = torch.nn.Linear(hidden, out_channels)
        self.dropout = dropout

    def forward(self, x, edge_index):
        for conv, norm in zip(self.convs, self.norms):
            x = F.relu(norm(conv(x, edge_index)))
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.head(x)


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    preds, ys = [], []
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        preds.append(out.argmax(dim=-1, keepdim=True).cpu())
        ys.append(batch.y[: batch.batch_size].cpu())
    return torch.cat(ys), torch.cat(preds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/data/ogb")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--out_dir", default="outputs/arxiv_sage")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s [rank %(process)d] %(message)s")

    if rank == 0:
        PygNodePropPredDataset("ogbn-arxiv", root=args.root)
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-arxiv", root=args.root, transform=T.ToUndirected())
    data = dataset[0]
    split_idx = dataset.get_idx_split()
    evaluator = Evaluator("ogbn-arxiv")

    train_idx = split_idx["train"]
    g = torch.Generator().manual_seed(0)
    train_idx = train_idx[torch.randperm(train_idx.numel(), generator=g)]
    n_local = train_idx.numel() // world_size
    local_train = train_idx[rank * n_local:(rank + 1) * n_local]

    train_loader = NeighborLoader(data, input_nodes=local_train, num_neighbors=[15, 10, 5],
                                  batch_size=args.batch_size, shuffle=True,
                                  num_workers=args.num_workers, persistent_workers=True)
    eval_loaders = {
        split: NeighborLoader(data, input_nodes=split_idx[split], num_neighbors=[-1, -1, -1],
                              batch_size=2048, shuffle=False, num_workers=args.num_workers)
        for split in ("valid", "test")
    } if rank == 0 else {}

    model = SAGE(data.num_features, args.hidden, dataset.num_classes,
                 args.num_layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * len(train_loader))

    os.makedirs(args.out_dir, exist_ok=True)
    best_path = os.path.join(args.out_dir, "best_model.pt")
    best_val = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size].view(-1))
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        if rank == 0:
            y_true, y_pred = predict(model.module, eval_loaders["valid"], device)
            val_acc = evaluator.eval({"y_true": y_true, "y_pred": y_pred})["acc"]
            log.info("epoch %03d loss %.4f val %.4f (%.1fs)", epoch,
                     (loss_sum[0] / loss_sum[1]).item(), val_acc, time.time() - t0)
            if val_acc > best_val:
                best_val = val_acc
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        # fresh single-GPU model for the final test pass
        final = SAGE(data.num_features, args.hidden, dataset.num_classes,
                     args.num_layers, args.dropout).to(device)
        final.load_state_dict(torch.load(best_path, map_location=device))
        y_true, y_pred = predict(final, eval_loaders["test"], device)
        test_acc = evaluator.eval({"y_true": y_true, "y_pred": y_pred})["acc"]
        log.info("best val %.4f | test %.4f", best_val, test_acc)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
