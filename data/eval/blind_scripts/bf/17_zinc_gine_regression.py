"""Constrained solubility regression on ZINC (12k subset) with GINE + DDP.

    torchrun --standalone --nproc_per_node=4 17_zinc_gine_regression.py --epochs 300
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from torch_geometric.datasets import ZINC
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINEConv, global_add_pool


NUM_ATOM_TYPES = 28
NUM_BOND_TYPES = 4


class GINE(nn.Module):
    def __init__(self, hidden=128, num_layers=4, dropout=0.0):
        super().__init__()
        self.atom_emb = nn.Embedding(NUM_ATOM_TYPES, hidden)
        self.bond_embs = nn.ModuleList([nn.Embedding(NUM_BOND_TYPES, hidden)
                                        for _ in range(num_layers)])
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        for _ in range(num_layers):
            mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
            self.convs.append(GINEConv(mlp, train_eps=True))
            self.norms.append(nn.LayerNorm(hidden))
        self.readout = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.dropout = dropout

    def forward(self, data):
        h = self.atom_emb(data.x.squeeze(-1))
        for conv, norm, bond_emb in zip(self.convs, self.norms, self.bond_embs):
            e = bond_emb(data.edge_attr)
            h = h + F.dropout(F.relu(norm(conv(h, data.edge_index, e))),
                              p=self.dropout, training=self.training)
        return self.readout(global_add_pool(h, data.batch)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total_err, n = 0.0, 0
    for data in loader:
        data = data.to(device)
        total_err += (model(data) - data.y).abs().sum().item()
        n += data.num_graphs
    return total_err / n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/ZINC")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min_lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--logdir", default="runs/zinc_gine")
    parser.add_argument("--ckpt", default="checkpoints/zinc_gine.pt")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    if rank == 0:
        for split in ("train", "val", "test"):
            ZINC(args.root, subset=True, split=split)
    dist.barrier()
    train_dataset = ZINC(args.root, subset=True, split="train")
    val_dataset = ZINC(args.root, subset=True, split="val")
    test_dataset = ZINC(args.root, subset=True, split="test")

    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.num_workers, pin_memory=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_dataset, batch_size=1000)
    test_loader = DataLoader(test_dataset, batch_size=1000)

    model = GINE(args.hidden, args.num_layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5,
                                                           patience=10, min_lr=args.min_lr)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    best_val = float("inf")
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.l1_loss(model(data), data.y)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * data.num_graphs,
                                     torch.tensor(float(data.num_graphs), device=device)])
        dist.all_reduce(loss_sum)
        train_mae = (loss_sum[0] / loss_sum[1]).item()

        # rank 0 evaluates; the validation MAE is broadcast so every rank's
        # plateau scheduler takes the same decision
        metrics = torch.zeros(2, device=device)
        if rank == 0:
            metrics[0] = evaluate(model.module, val_loader, device)
            metrics[1] = evaluate(model.module, test_loader, device)
        dist.broadcast(metrics, src=0)
        val_mae, test_mae = metrics.tolist()
        scheduler.step(val_mae)

        if rank == 0:
            lr = optimizer.param_groups[0]["lr"]
            writer.add_scalar("mae/train", train_mae, epoch)
            writer.add_scalar("mae/val", val_mae, epoch)
            writer.add_scalar("mae/test", test_mae, epoch)
            writer.add_scalar("lr", lr, epoch)
            print(f"epoch {epoch:03d} train {train_mae:.4f} val {val_mae:.4f} "
                  f"test {test_mae:.4f} lr {lr:.1e} ({time.time() - t0:.1f}s)", flush=True)
            if val_mae < best_val:
                best_val = val_mae
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "val_mae": val_mae, "test_mae": test_mae}, args.ckpt)

        if optimizer.param_groups[0]["lr"] <= args.min_lr:
            if rank == 0:
                print("reached min lr, stopping")
            break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
