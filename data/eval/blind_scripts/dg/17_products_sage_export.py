"""Train GraphSAGE on ogbn-products with sampled mini-batches on all GPUs, keep
the best checkpoint by sampled validation accuracy, then reload it into a
fresh model for exact full-neighbourhood (layer-wise) inference and export
the final node embeddings / predictions.

    torchrun --standalone --nproc_per_node=4 17_products_sage_export.py --out runs/sage_export
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


class SAGE(torch.nn.Module):
    def __init__(self, in_c, hid_c, out_c, num_layers=3, dropout=0.5):
        super().__init__()
        self.convs = torch.nn.ModuleList([SAGEConv(in_c, hid_c)])
        self.convs.extend(SAGEConv(hid_c, hid_c) for _ in range(num_layers - 2))
        self.convs.append(SAGEConv(hid_c, out_c))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i + 1 < len(self.convs):
                x = F.dropout(F.relu(x), p=self.dropout, training=self.training)
        return x

    @torch.no_grad()
    def inference(self, x_all, loader, device):
        hidden = None
        for i, conv in enumerate(self.convs):
            buf = []
            for batch in loader:
                h = conv(x_all[batch.n_id].to(device), batch.edge_index.to(device))
                if i + 1 < len(self.convs):
                    h = F.relu(h)
                buf.append(h[: batch.batch_size].cpu())
            x_all = torch.cat(buf)
            if i == len(self.convs) - 2:
                hidden = x_all
        return x_all, hidden


@torch.no_grad()
def sampled_accuracy(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch.x, batch.edge_index)[: batch.batch_size].argmax(-1)
        t[0] += (pred == batch.y[: batch.batch_size].view(-1)).sum()
        t[1] += batch.batch_size
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--out", default="runs/sage_export")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=args.root)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-products", root=args.root)
    data = dataset[0]
    split_idx = dataset.get_idx_split()

    chunk = split_idx["train"].numel() // world_size
    train_idx = split_idx["train"][rank * chunk:(rank + 1) * chunk]
    valid_idx = split_idx["valid"].tensor_split(world_size)[rank]

    train_loader = NeighborLoader(data, input_nodes=train_idx, num_neighbors=args.fanout,
                                  batch_size=args.batch_size, shuffle=True, drop_last=True,
                                  num_workers=4, persistent_workers=True)
    valid_loader = NeighborLoader(data, input_nodes=valid_idx, num_neighbors=args.fanout,
                                  batch_size=4096, num_workers=2)

    model = SAGE(dataset.num_features, args.hidden, dataset.num_classes).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    best_path = os.path.join(args.out, "best_model.pt")

    best_val = -1.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        stat = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size].view(-1))
            loss.backward()
            optimizer.step()
            stat[0] += loss.detach()
            stat[1] += 1
        dist.all_reduce(stat)
        val_acc = sampled_accuracy(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(stat[0] / stat[1]).item():.4f} "
                  f"val(sampled) {val_acc:.4f} {time.time() - t0:.0f}s", flush=True)
            if val_acc > best_val:
                best_val = val_acc
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    dist.destroy_process_group()

    if rank != 0:
        return

    # exact evaluation + export, single GPU
    final = SAGE(dataset.num_features, args.hidden, dataset.num_classes)
    final.load_state_dict(torch.load(best_path, map_location="cpu"))
    final = final.to(device).eval()
    subgraph_loader = NeighborLoader(copy.copy(data), input_nodes=None, num_neighbors=[-1],
                                     batch_size=4096, shuffle=False, num_workers=8)
    logits, emb = final.inference(data.x, subgraph_loader, device)
    y_pred = logits.argmax(dim=-1, keepdim=True)
    evaluator = Evaluator("ogbn-products")
    for split in ("train", "valid", "test"):
        idx = split_idx[split]
        acc = evaluator.eval({"y_true": data.y[idx], "y_pred": y_pred[idx]})["acc"]
        print(f"{split} acc (full neighbourhood): {acc:.4f}")
    torch.save({"embeddings": emb.half(), "pred": y_pred.view(-1)},
               os.path.join(args.out, "products_export.pt"))


if __name__ == "__main__":
    main()
