"""A stream that splits itself between the ranks, and a test set only rank 0
reads (no finding expected): neither loader needs a DistributedSampler.

torchrun --nproc_per_node=2 correct_iterable_dataset_split_by_rank.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


class RankStream(IterableDataset):
    """Sample i goes to rank i % world_size: the ranks never read the same one."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        generator = torch.Generator().manual_seed(0)
        for index in range(self.size):
            x = torch.randn(8, generator=generator)
            if index % world_size == rank:
                yield x, x.sum(dim=0, keepdim=True)


def evaluate(model: nn.Module, loader: DataLoader) -> float:
    with torch.no_grad():
        return sum(nn.functional.mse_loss(model(x), y).item() for x, y in loader)


def main() -> None:
    dist.init_process_group("gloo")
    stream = RankStream(256)
    train_loader = DataLoader(stream, batch_size=16)
    test_loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=32)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        for inputs, targets in train_loader:
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: test loss {evaluate(model.module, test_loader):.3f}", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
