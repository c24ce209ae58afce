"""A `build_or_load` helper that returns the cache when its file exists and
otherwise builds and writes it, called by every rank: on the first run every
rank misses the file and writes it at once. The same for a loop that skips
each cached file already there and builds the others."""

import os
import pickle

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
    np.save(cache, ids)  # expect: dataset-cache-race
    return np.load(cache, mmap_mode="r")


def load_or_parse_labels(path, cache):
    if os.path.isfile(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    labels = [int(line) for line in open(path)]
    with open(cache, "wb") as f:
        pickle.dump(labels, f)  # expect: dataset-cache-race
    return labels


def density_maps(annotations, folder):
    # one cached file per image: those already there are skipped, the rest built
    paths = []
    for name, points in annotations.items():
        path = os.path.join(folder, name + ".npy")
        paths.append(path)
        if os.path.exists(path):
            continue
        density = np.zeros((64, 64), dtype=np.float32)
        density[points[:, 1], points[:, 0]] = 1.0
        np.save(path, density)  # expect: dataset-cache-race
    return paths


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    ids = load_or_tokenize(["corpus/a.txt", "corpus/b.txt"], "corpus/ids.npy")
    labels = load_or_parse_labels("corpus/labels.txt", "corpus/labels.pkl")
    density_maps({"a": np.zeros((1, 2), dtype=np.int64)}, "corpus/density")
    data = TensorDataset(torch.from_numpy(np.array(ids[: len(labels)], dtype=np.float32)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
    model = DDP(nn.Linear(1, 1).cuda(local_rank), device_ids=[local_rank])
    for (x,) in loader:
        model(x.unsqueeze(1).cuda(local_rank)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
