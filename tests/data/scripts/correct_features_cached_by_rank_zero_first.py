"""Rank 0 builds the features cache while the others wait; then they load it.

The Hugging Face examples' load_and_cache_examples: `if rank != 0: barrier()`
before the cache, `if rank == 0: barrier()` after it. Lint only.
"""

import os

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset


def load_and_cache_examples(data_dir: str, split: str, rank: int) -> TensorDataset:
    if rank != 0:
        dist.barrier()
    cached_features_file = os.path.join(data_dir, f"cached_{split}.pt")
    if os.path.exists(cached_features_file):
        features = torch.load(cached_features_file)
    else:
        features = {"input_ids": torch.randint(0, 100, (64, 16))}
        torch.save(features, cached_features_file)
    if rank == 0:
        dist.barrier()
    return TensorDataset(features["input_ids"])


def main():
    dist.init_process_group("gloo")
    train = load_and_cache_examples(".", "train", dist.get_rank())
    print(len(train))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
