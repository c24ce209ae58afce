"""Inductive node classification on PPI (121 labels, micro-F1) with GAT, DDP.

The 20 training graphs are split over the ranks with a DistributedSampler;
validation / test graphs are scored on rank 0.

    torchrun --standalone --nproc_per_node=4 18_ppi_gat_inductive.py --epochs 200
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import PPI
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GATConv


class GAT(torch.nn.Module):
    def __init__(self, in_channels, out_channels, hidden=256, heads=4):
        super().__init__()
        self.conv1 = GATConv(in_channels, hidden, heads=heads)
        self.lin1 = torch.nn.Linear(in_channels, hidden * heads)
        self.conv2 = GATConv(hidden * heads, hidden, heads=heads)
        self.lin2 = torch.nn.Linear(hidden * heads, hidden * heads)
        self.conv3 = GATConv(hidden * heads, out_channels, heads=6, concat=False)
        self.lin3 = torch.nn.Linear(hidden * heads, out_channels)

    def forward(self, x, edge_index):
        x = F.elu(self.conv1(x, edge_index) + self.lin1(x))
        x = F.elu(self.conv2(x, edge_index) + self.lin2(x))
        return self.conv3(x, edge_index) + self.lin3(x)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ys, preds = [], []
    for data in loader:
        ys.append(data.y)
        out = model(data.x.to(device), data.edge_index.to(device))
        preds.append((out > 0).float().cpu())
    y, pred = torch.cat(ys, dim=0).numpy(), torch.cat(preds, dim=0).numpy()
    return f1_score(y, pred, average="micro") if pred.sum() > 0 else 0.0


def save_checkpoint(state, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/PPI")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=1, help="graphs per GPU")
    parser.add_argument("--ckpt_dir", default="checkpoints/ppi_gat")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        for split in ("train", "val", "test"):
            PPI(args.root, split=split)
    dist.barrier()
    train_dataset = PPI(args.root, split="train")
    val_dataset = PPI(args.root, split="val")
    test_dataset = PPI(args.root, split="test")

    sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(val_dataset, batch_size=2, shuffle=False)
    test_loader = DataLoader(test_dataset, batch_size=2, shuffle=False)

    model = GAT(train_dataset.num_features, train_dataset.num_classes,
                hidden=args.hidden, heads=args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_op = torch.nn.BCEWithLogitsLoss()

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    start_epoch, best_val = 1, 0.0
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_val = ckpt["epoch"] + 1, ckpt["best_val"]

    for epoch in range(start_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device)
            optimizer.zero_grad()
            loss = loss_op(model(data.x, data.edge_index), data.y)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * data.num_graphs,
                                  torch.tensor(float(data.num_graphs), device=device)])
        dist.all_reduce(total)

        if rank == 0:
            val_f1 = evaluate(model.module, val_loader, device)
            test_f1 = evaluate(model.module, test_loader, device)
            print(f"Epoch {epoch:03d}, Loss {(total[0] / total[1]).item():.4f}, "
                  f"Val F1 {val_f1:.4f}, Test F1 {test_f1:.4f}, {time.time() - t0:.2f}s")
            if val_f1 > best_val:
                best_val = val_f1
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best.pt"))

        save_checkpoint({"epoch": epoch, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "best_val": best_val}, last_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
