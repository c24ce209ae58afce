"""A streamed dataset and a hand-written IterableDataset that no rank splits:
a DistributedSampler cannot cut a stream, so every rank trains on the same
examples."""

import glob
import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset


class Lines(IterableDataset):
    def __init__(self, files):
        self.files = files

    def __iter__(self):
        for path in self.files:
            with open(path) as f:
                for line in f:
                    yield torch.tensor([float(len(line))])


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(1, 1).cuda(), device_ids=[local_rank])
    web = load_dataset("some/corpus", split="train", streaming=True).shuffle(buffer_size=1000)
    web_loader = DataLoader(web.with_format("torch"), batch_size=8)  # expect: missing-distributed-sampler
    files = sorted(glob.glob("data/*.txt"))
    lines = DataLoader(Lines(files), batch_size=8)  # expect: missing-distributed-sampler
    for step, batch in enumerate(lines):
        model(batch.cuda()).sum().backward()
        if step == 1000:
            break
    for batch in web_loader:
        model(batch["x"].cuda()).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
