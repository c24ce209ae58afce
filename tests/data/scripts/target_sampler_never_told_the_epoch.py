"""Domain adaptation with a source and a target loader, each with its own
shuffling DistributedSampler: the epoch loop tells the source sampler the
epoch and never the target's, so every epoch reads the target domain in the
same order, split between the ranks the same way."""

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
    source = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    target = TensorDataset(torch.randn(512, 16))
    src_sampler = DistributedSampler(source, shuffle=True)
    tgt_sampler = DistributedSampler(target, shuffle=True, seed=1)  # expect: sampler-set-epoch
    src_loader = DataLoader(source, batch_size=32, sampler=src_sampler)
    tgt_loader = DataLoader(target, batch_size=32, sampler=tgt_sampler)
    model = DDP(nn.Linear(16, 4).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(20):
        src_sampler.set_epoch(epoch)
        for (xs, ys), (xt,) in zip(src_loader, tgt_loader):
            loss = nn.functional.cross_entropy(model(xs.cuda()), ys.cuda())
            loss = loss + model(xt.cuda()).softmax(1).max(1).values.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
