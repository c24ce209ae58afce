"""Every rank tokenizes the corpus and writes the same features cache at once.

torchrun --nproc_per_node=2 features_cached_by_every_rank.py
The rank-0-first barriers cover only the model download; the features cache is
built after them, by every rank together, into one file.
"""

import os

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset


def load_and_cache_examples(data_dir: str, split: str) -> TensorDataset:
    cached_features_file = os.path.join(data_dir, f"cached_{split}.pt")
    if os.path.exists(cached_features_file):
        features = torch.load(cached_features_file)
    else:
        features = {"input_ids": torch.randint(0, 100, (64, 16))}
        torch.save(features, cached_features_file)  # expect: dataset-cache-race
    return TensorDataset(features["input_ids"])


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank != 0:
        dist.barrier()  # the others wait while rank 0 downloads the model
    print("model ready")
    if rank == 0:
        dist.barrier()
    train = load_and_cache_examples(".", "train")
    print(rank, len(train))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
