"""GraphSAGE on ogbn-products under torchrun: every rank's NeighborLoader samples
from every training node. A graph loader takes no DistributedSampler, so each
of the N ranks trains on the whole split and an epoch costs N times the work
with no speed-up. Linted, not run: PyG and the dataset are not installed here.

    torchrun --nproc_per_node=4 graph_loader_seeds_not_split_by_rank.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ogb.nodeproppred import PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GraphSAGE


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:  # downloads and processes on first use: rank 0 first, the others wait
        PygNodePropPredDataset("ogbn-products", root="data")
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-products", root="data")
    split_idx = dataset.get_idx_split()
    data = dataset[0]
    train_loader = NeighborLoader(  # expect: missing-distributed-sampler
        data, input_nodes=split_idx["train"], num_neighbors=[15, 10], batch_size=1024, shuffle=True
    )
    model = GraphSAGE(dataset.num_features, 256, 3, dataset.num_classes).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(10):
        for batch in train_loader:
            batch = batch.cuda()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size].view(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} on {world_size} ranks")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
