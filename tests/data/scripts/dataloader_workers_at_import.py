import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
dataset = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
sampler = DistributedSampler(dataset)
loader = DataLoader(dataset, 32, sampler=sampler, num_workers=4)  # expect: missing-main-guard
model = DDP(nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters())
for x, y in loader:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
dist.destroy_process_group()
