"""A detector trained from a detectron2-style config whose IMS_PER_BATCH is the
batch across all machines (the 0.02 learning rate and the iteration schedule are
written for 16 images), handed to every process's loader as its own batch size:
with 8 GPUs each step averages 128 images."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CFG = {
    "SOLVER": {
        "IMS_PER_BATCH": 16,  # images per batch across all machines
        "BASE_LR": 0.02,
        "MAX_ITER": 90000,
    }
}


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    data = TensorDataset(torch.randn(4096, 32), torch.randint(0, 10, (4096,)))
    loader = DataLoader(
        data,
        batch_size=CFG["SOLVER"]["IMS_PER_BATCH"],  # expect: effective-batch-size-changed
        sampler=DistributedSampler(data),
    )
    model = DDP(nn.Linear(32, 10).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=CFG["SOLVER"]["BASE_LR"], momentum=0.9)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
