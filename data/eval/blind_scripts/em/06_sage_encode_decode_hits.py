"""
GraphSAGE encoder + MLP decoder for "also bought" link prediction.

Expects the split produced by prep/make_link_split.py (train/val/test Data objects,
val/test carry edge_label_index with label 1 for positives and 0 for negatives).

Run:
    torchrun --nproc_per_node=8 sage_also_bought.py --split /mnt/graphs/also_bought/split_v3.pt
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="also-bought link prediction")
    parser.add_argument("--split", type=str, required=True)
    parser.add_argument("--save-dir", type=str, default="/mnt/experiments/also_bought")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    parser.add_argument("--batch-size", type=int, default=512, help="per GPU (lr tuned at 8 GPUs)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--hits", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=100)
    return parser.parse_args()


class LinkPredictor(nn.Module):
    def __init__(self, in_channels, hidden, num_layers, dropout=0.25):
        super().__init__()
        self.convs = nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden))
        for _ in range(num_layers - 1):
            self.convs.append(SAGEConv(hidden, hidden))
        self.dropout = dropout
        self.mlp = nn.Sequential(
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )

    def encode(self, x, edge_index):
        for conv in self.convs[:-1]:
            x = conv(x, edge_index).relu()
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.convs[-1](x, edge_index)

    def decode(self, z, edge_label_index):
        return self.mlp(z[edge_label_index[0]] * z[edge_label_index[1]]).squeeze(-1)

    def forward(self, x, edge_index, edge_label_index):
        return self.decode(self.encode(x, edge_index), edge_label_index)


@torch.no_grad()
def evaluate(model, data, ks, rank, world_size, device):
    """OGB-style Hits@K: a positive counts if it beats the K-th best negative."""
    model.eval()
    z = model.encode(data.x.to(device), data.edge_index.to(device))
    eli = data.edge_label_index.to(device)
    lbl = data.edge_label.to(device)
    pos_idx = (lbl == 1).nonzero().view(-1)[rank::world_size]
    neg_idx = (lbl == 0).nonzero().view(-1)[rank::world_size]

    pos_scores = torch.cat([model.decode(z, eli[:, c]) for c in pos_idx.split(65536)])
    neg_scores = torch.cat([model.decode(z, eli[:, c]) for c in neg_idx.split(65536)])

    kmax = max(ks)
    local_top = neg_scores.topk(kmax).values
    all_top = [torch.empty_like(local_top) for _ in range(world_size)]
    dist.all_gather(all_top, local_top)
    global_top = torch.cat(all_top).topk(kmax).values

    counts = torch.zeros(len(ks) + 1, device=device)
    for j, k in enumerate(ks):
        counts[j] = (pos_scores > global_top[k - 1]).sum()
    counts[-1] = pos_scores.numel()
    dist.all_reduce(counts)
    model.train()
    return {f"hits@{k}": (counts[j] / counts[-1]).item() for j, k in enumerate(ks)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.ERROR,
        format="%(asctime)s %(levelname)s %(message)s",
    )

    train_data, val_data, test_data = torch.load(args.split)
    logger.info("nodes=%d feat=%d train_msg_edges=%d sup_edges=%d", train_data.num_nodes,
                train_data.num_features, train_data.edge_index.size(1), train_data.edge_label_index.size(1))

    n = train_data.edge_label_index.size(1)
    per_rank = n // world_size
    g = torch.Generator().manual_seed(2024)
    perm = torch.randperm(n, generator=g)
    mine = perm[rank * per_rank:(rank + 1) * per_rank]
    loader = LinkNeighborLoader(
        train_data,
        num_neighbors=args.fanout,
        edge_label_index=train_data.edge_label_index[:, mine],
        edge_label=train_data.edge_label[mine],
        neg_sampling_ratio=1.0,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.num_workers,
        pin_memory=True,
    )

    model = LinkPredictor(train_data.num_features, args.hidden, args.num_layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "tb"))

    best, global_step = -1.0, 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            out = model(batch.x, batch.edge_index, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(out, batch.edge_label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1
            if writer is not None and global_step % args.log_every == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)

        metrics = evaluate(model, val_data, args.hits, rank, world_size, device)
        logger.info("epoch %d (%.0fs) val %s", epoch, time.time() - t0, metrics)
        if rank == 0:
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            score = metrics[f"hits@{args.hits[1]}"]
            if score > best:
                best = score
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict()},
                           os.path.join(args.save_dir, "best.pt"))

    dist.barrier()
    ckpt = torch.load(os.path.join(args.save_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["state_dict"])
    metrics = evaluate(model, test_data, args.hits, rank, world_size, device)
    logger.info("test @ epoch %d: %s", ckpt["epoch"], metrics)
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
