"""A trainer class whose DistributedSampler shuffles, but nobody tells it the
epoch: every epoch visits the samples in the same order on every rank.

torchrun --nproc_per_node=2 sampler_set_epoch_never_called.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, dataset: TensorDataset, epochs: int) -> None:
        self.epochs = epochs
        self.sampler = DistributedSampler(dataset, shuffle=True)  # expect: sampler-set-epoch
        self.loader = DataLoader(dataset, batch_size=16, sampler=self.sampler)
        self.model = DDP(nn.Linear(8, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_one_epoch(self) -> float:
        first = None
        for inputs, targets in self.loader:
            first = inputs[0, 0].item() if first is None else first
            loss = nn.functional.mse_loss(self.model(inputs), targets)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        return first

    def fit(self) -> None:
        for epoch in range(self.epochs):
            first = self.train_one_epoch()
            print(f"[rank {dist.get_rank()}] epoch {epoch} starts with {first:.4f}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    data = TensorDataset(torch.randn(128, 8), torch.randn(128, 1))
    Trainer(data, epochs=3).fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
