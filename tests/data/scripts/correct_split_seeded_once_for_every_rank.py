"""Every rank draws the same split and the same class numbering.

random_split is given a generator seeded with a constant; sklearn's and a
Hugging Face dataset's train_test_split a random_state / seed; the class
names are numbered in sorted order; and a split after a common seed for the
whole process (torch.manual_seed(42) on every rank, as seed_everything does)
is the same on every rank too. Per-rank seeds are set only after the split,
for augmentation. A split by hand permutes the indices with a generator
seeded alike on every rank, and a list of files is shuffled by a
`random.Random` of its own seeded alike. Run with two ranks, rank 0 prints that the splits and the
class maps agree.
"""

import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset, random_split


def split(dataset):
    n_val = len(dataset) // 4
    generator = torch.Generator().manual_seed(42)
    return random_split(dataset, [len(dataset) - n_val, n_val], generator=generator)


def split_frame(frame):
    from sklearn.model_selection import train_test_split

    return train_test_split(frame, test_size=0.1, random_state=42)


def split_hub_dataset(dataset):
    return dataset.train_test_split(test_size=0.1, seed=42)


def split_indices(n):
    idx = np.random.default_rng(42).permutation(n)
    val_idx, train_idx = idx[: n // 4], idx[n // 4 :]
    return train_idx, val_idx


def split_files(files):
    files = list(files)
    random.Random(42).shuffle(files)
    val_files, train_files = files[:4], files[4:]
    return train_files, val_files


def class_index(names):
    return {name: i for i, name in enumerate(sorted(set(names)))}


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)  # the same on every rank: the unseeded split below agrees
    data = TensorDataset(torch.arange(400, dtype=torch.float32)[:, None])
    _, val = split(data)
    _, val_too = random_split(data, [300, 100])
    torch.manual_seed(1000 + rank)  # augmentation differs per rank, after the split
    np.random.seed(1000 + rank)
    random.seed(1000 + rank)
    _, val_idx = split_indices(len(data))
    _, val_files = split_files([f"drive_{i:02d}" for i in range(16)])
    model = DDP(torch.nn.Linear(1, 1))
    splits = [None] * world
    drawn = (sorted(val.indices), sorted(val_too.indices), sorted(val_idx.tolist()), sorted(val_files))
    dist.all_gather_object(splits, drawn)
    names = [f"species_{letter}" for letter in "abcdefghijklmnopqrstuvwxyz"]
    maps = [None] * world
    dist.all_gather_object(maps, class_index(names))
    if rank == 0:
        print("splits", "agree" if all(s == splits[0] for s in splits) else "differ")
        permuted = [s[2] for s in splits]
        print("permuted splits", "agree" if all(p == permuted[0] for p in permuted) else "differ")
        shuffled = [s[3] for s in splits]
        print("shuffled file splits", "agree" if all(f == shuffled[0] for f in shuffled) else "differ")
        print("class maps", "agree" if all(m == maps[0] for m in maps) else "differ")
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
