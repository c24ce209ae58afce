"""Sampled GCN on ogbn-products, DDP, with periodic checkpoints and resume.

    torchrun --standalone --nproc_per_node=8 05_gcn_products_resume.py \
        --ckpt_dir /shared/ckpt/gcn_products --resume auto
"""
import argparse
import glob
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GCNConv


class GCN(torch.nn.Module):
    def __init__(self, in_dim, hid_dim, out_dim, num_layers=3, dropout=0.5):
        super().__init__()
        dims = [in_dim] + [hid_dim] * (num_layers - 1) + [out_dim]
        self.convs = torch.nn.ModuleList(
            GCNConv(dims[i], dims[i + 1], cached=False) for i in range(num_layers)
        )
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i != len(self.convs) - 1:
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


def latest_checkpoint(ckpt_dir):
    files = glob.glob(os.path.join(ckpt_dir, "epoch_*.pt"))
    if not files:
        return None
    return max(files, key=lambda f: int(re.findall(r"epoch_(\d+)\.pt", f)[0]))


@torch.no_grad()
def evaluate(model, loader, evaluator, device):
    """Accuracy over the shards of all ranks (correct / count are summed)."""
    model.eval()
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        y = batch.y[: batch.batch_size].view(-1)
        correct += (out.argmax(-1) == y).sum()
        count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--ckpt_dir", default="ckpt/gcn_products")
    ap.add_argument("--resume", default="", help="path, or 'auto' for the latest in ckpt_dir")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--num_layers", type=int, default=3)
    ap.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--save_every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=args.root)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-products", root=args.root)
    data = dataset[0]
    split_idx = dataset.get_idx_split()
    evaluator = Evaluator("ogbn-products")

    def shard(idx):
        n = idx.numel() // world
        return idx[rank * n:(rank + 1) * n]

    loader_kw = dict(num_neighbors=args.fanout, num_workers=4, persistent_workers=True)
    train_loader = NeighborLoader(data, input_nodes=shard(split_idx["train"]),
                                  batch_size=args.batch_size, shuffle=True,
                                  drop_last=True, **loader_kw)
    val_loader = NeighborLoader(data, input_nodes=shard(split_idx["valid"]),
                                batch_size=4096, **loader_kw)
    test_loader = NeighborLoader(data, input_nodes=shard(split_idx["test"]),
                                 batch_size=4096, **loader_kw)

    model = GCN(dataset.num_features, args.hidden, dataset.num_classes, args.num_layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.5)

    start_epoch, best_val = 1, 0.0
    resume_path = latest_checkpoint(args.ckpt_dir) if args.resume == "auto" else args.resume
    if resume_path:
        ckpt = torch.load(resume_path)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        best_val = ckpt.get("best_val", 0.0)
        if rank == 0:
            print(f"resumed from {resume_path} at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs + 1):
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad(set_to_none=True)
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size].view(-1))
            loss.backward()
            optimizer.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_acc)

        val_acc = evaluate(model.module, val_loader, evaluator, device)
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {loss_acc[0] / loss_acc[1]:.4f}  "
                  f"val {val_acc:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                  f"{time.time() - t0:.0f}s", flush=True)

        improved = val_acc > best_val
        best_val = max(best_val, val_acc)
        if rank == 0 and (epoch % args.save_every == 0 or improved):
            state = {
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "best_val": best_val,
            }
            if epoch % args.save_every == 0:
                torch.save(state, os.path.join(args.ckpt_dir, f"epoch_{epoch}.pt"))
            if improved:
                torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    test_acc = evaluate(model.module, test_loader, evaluator, device)
    if rank == 0:
        print(f"final: best val {best_val:.4f}, test {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
