#!/usr/bin/env python
"""PyG GraphSAGE on Reddit, multi-GPU with NeighborLoader and DDP.

Train seeds are split across ranks (equal share, reshuffled each epoch with a
common seed); validation / test use sampled inference on every rank and the
counts are all-reduced.

    torchrun --standalone --nproc_per_node=4 16_pyg_sage_reddit.py --epochs 20
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.datasets import Reddit
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GraphSAGE

log = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="GraphSAGE / Reddit / DDP")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--root", default="data/Reddit")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--num-neighbors", type=int, nargs="+", default=[25, 10])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--save", default="ckpt/sage_reddit.pt")
    return parser.parse_args()


def seed_loader(data, seeds, args, shuffle):
    return NeighborLoader(data, input_nodes=seeds, num_neighbors=args.num_neighbors,
                          batch_size=args.batch_size, shuffle=shuffle, drop_last=shuffle,
                          num_workers=args.num_workers, persistent_workers=False)


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    correct = torch.zeros(2, dtype=torch.long, device=device)
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        correct[0] += (out.argmax(-1) == batch.y[: batch.batch_size]).sum()
        correct[1] += batch.batch_size
    dist.all_reduce(correct)
    model.train()
    return correct[0].item() / correct[1].item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"[rank {rank}] %(asctime)s %(message)s")

    dataset = Reddit(args.root)
    data = dataset[0]
    train_idx = data.train_mask.nonzero(as_tuple=False).view(-1)
    val_idx = data.val_mask.nonzero(as_tuple=False).view(-1)
    test_idx = data.test_mask.nonzero(as_tuple=False).view(-1)
    val_loader = seed_loader(data, val_idx.split(val_idx.size(0) // world_size)[rank], args, False)
    test_loader = seed_loader(data, test_idx.split(test_idx.size(0) // world_size)[rank], args, False)

    torch.manual_seed(12345)
    model = GraphSAGE(dataset.num_features, args.hidden, num_layers=len(args.num_neighbors),
                      out_channels=dataset.num_classes, dropout=0.5).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    per_rank = train_idx.numel() // world_size
    best_val = 0.0
    for epoch in range(1, args.epochs + 1):
        gen = torch.Generator().manual_seed(epoch)
        perm = train_idx[torch.randperm(train_idx.numel(), generator=gen)]
        my_idx = perm[rank * per_rank:(rank + 1) * per_rank]
        loader = seed_loader(data, my_idx, args, shuffle=True)

        model.train()
        t0 = time.time()
        total_loss = total_examples = 0
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            optimizer.step()
            total_loss += float(loss) * batch.batch_size
            total_examples += batch.batch_size
        log.info("epoch %02d loss %.4f time %.1fs", epoch, total_loss / total_examples,
                 time.time() - t0)

        if epoch % 5 == 0:
            val_acc = test(model, val_loader, device)
            test_acc = test(model, test_loader, device)
            log.info("epoch %02d val %.4f test %.4f", epoch, val_acc, test_acc)
            if rank == 0 and val_acc > best_val:
                best_val = val_acc
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save(model.module.state_dict(), args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
