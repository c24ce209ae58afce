"""Steps skipped the right way under DDP: the ranks agree on the skip (a flag
all-reduced first), the loss is zeroed instead of skipped, the skip depends
on the step count (the same on every rank), or the loop has nothing to wait
for (an evaluation whose totals are reduced after the loop)."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(8, 1).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x.cuda(local_rank)), y.cuda(local_rank))
        bad = (~torch.isfinite(loss)).float()
        dist.all_reduce(bad)
        if bad.item() > 0:
            optimizer.zero_grad()
            continue  # every rank skips this step together
        if step % 100 == 99:
            continue  # the same step on every rank
        loss = torch.nan_to_num(loss)  # or keep the step with a zeroed loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    total = torch.zeros(2, device=f"cuda:{local_rank}")
    with torch.no_grad():
        for x, y in loader:
            if x is None:
                continue
            out = model.module(x.cuda(local_rank))
            if torch.isnan(out).any():
                continue
            total += torch.stack([out.sum(), torch.tensor(float(len(x)), device=out.device)])
    dist.all_reduce(total)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
