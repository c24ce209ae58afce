"""The same `load_or_tokenize` helper, called by rank 0 while the others wait
in a barrier, then by every rank (they find the file); and a helper whose
early return does not test a file."""

import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def load_or_tokenize(corpus, cache):
    if os.path.exists(cache):
        return np.load(cache, mmap_mode="r")
    ids = np.concatenate([np.frombuffer(open(f, "rb").read(), dtype=np.uint8) for f in corpus])
    np.save(cache, ids)
    return np.load(cache, mmap_mode="r")


def save_stats(ids, path, rank):
    if rank != 0:
        return
    np.save(path, np.array([ids.mean(), ids.std()]))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    if rank == 0:
        load_or_tokenize(["corpus/a.txt", "corpus/b.txt"], "corpus/ids.npy")
    dist.barrier()
    ids = load_or_tokenize(["corpus/a.txt", "corpus/b.txt"], "corpus/ids.npy")
    save_stats(ids, "corpus/stats.npy", rank)
    data = TensorDataset(torch.from_numpy(np.array(ids, dtype=np.float32)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
    model = DDP(nn.Linear(1, 1).cuda(local_rank), device_ids=[local_rank])
    for (x,) in loader:
        model(x.unsqueeze(1).cuda(local_rank)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
