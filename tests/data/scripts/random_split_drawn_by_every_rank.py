"""Every rank draws its own train / validation split and numbers its own classes.

Under torchrun each process runs this setup itself: random_split with no
generator draws from the process's own unseeded torch generator, sklearn's
train_test_split with no random_state from its own numpy state, and
enumerate(set(names)) numbers the class names in an order Python's
per-process string hashing decides; a split after seeding with the rank
differs as well, and so does a split by hand: indices permuted by numpy
after seeding it with the rank, then sliced, or a list of file names
shuffled in place by `random` seeded with the rank. The ranks end up with different
validation sets (one rank validates on what the others train on) and
different labels for the same class. Run with two ranks, rank 0 prints
whether the splits and the class maps agree.
"""

import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset, random_split


def split(dataset):
    n_val = len(dataset) // 4
    return random_split(dataset, [len(dataset) - n_val, n_val])  # expect: rank-divergent-data-split


def split_frame(frame):
    from sklearn.model_selection import train_test_split

    return train_test_split(frame, test_size=0.1)  # expect: rank-divergent-data-split


def split_for_this_rank(dataset, rank):
    torch.manual_seed(1234 + rank)  # "reproducible", but another seed on every rank
    return random_split(dataset, [300, 100])  # expect: rank-divergent-data-split


def split_indices(n, rank):
    np.random.seed(1234 + rank)
    idx = np.random.permutation(n)  # expect: rank-divergent-data-split
    val_idx, train_idx = idx[: n // 4], idx[n // 4 :]
    return train_idx, val_idx


def split_files(files, rank):
    random.seed(1234 + rank)
    files = list(files)
    random.shuffle(files)  # expect: rank-divergent-data-split
    val_files, train_files = files[:4], files[4:]
    return train_files, val_files


def class_index(names):
    return {name: i for i, name in enumerate(set(names))}  # expect: rank-divergent-data-split


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(torch.nn.Linear(1, 1))
    data = TensorDataset(torch.arange(400, dtype=torch.float32)[:, None])
    _, val = split(data)
    _, val_seeded = split_for_this_rank(data, rank)
    _, val_idx = split_indices(len(data), rank)
    _, val_files = split_files([f"drive_{i:02d}" for i in range(16)], rank)
    splits = [None] * world
    drawn = (sorted(val.indices), sorted(val_seeded.indices), sorted(val_idx.tolist()), sorted(val_files))
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
