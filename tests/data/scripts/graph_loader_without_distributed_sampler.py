"""A graph classifier under torchrun: PyTorch Geometric's DataLoader is torch's
with a graph collate, so every rank still trains on the whole dataset."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.datasets import TUDataset
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GCNConv, global_mean_pool


class Net(torch.nn.Module):
    def __init__(self, features, classes):
        super().__init__()
        self.conv = GCNConv(features, 64)
        self.out = torch.nn.Linear(64, classes)

    def forward(self, data):
        h = self.conv(data.x, data.edge_index).relu()
        return self.out(global_mean_pool(h, data.batch))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    if dist.get_rank() == 0:  # downloads on first use: rank 0 first, the others wait
        TUDataset("data/TUDataset", name="MUTAG")
    dist.barrier()
    dataset = TUDataset("data/TUDataset", name="MUTAG")
    loader = DataLoader(dataset, batch_size=32, shuffle=True)  # expect: missing-distributed-sampler
    model = DDP(Net(dataset.num_features, dataset.num_classes).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for data in loader:
        data = data.cuda(local_rank)
        loss = torch.nn.functional.cross_entropy(model(data), data.y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
