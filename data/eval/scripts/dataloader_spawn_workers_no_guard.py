"""Everything at module level; the DataLoader starts its workers with "spawn"."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
dataset = TensorDataset(torch.randn(256, 10), torch.randn(256, 1))
sampler = DistributedSampler(dataset)
loader = DataLoader(
    dataset, batch_size=32, sampler=sampler, num_workers=2, multiprocessing_context="spawn"
)
model = DDP(nn.Linear(10, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
dist.destroy_process_group()
