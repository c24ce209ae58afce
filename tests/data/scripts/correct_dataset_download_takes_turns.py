"""Datasets downloaded with the ranks taking turns (no finding expected).

The three ways scripts do it: rank 0 downloads while the others wait in a
barrier and then find the files in place; the others wait in a barrier
before the shared call (yolov5's torch_distributed_zero_first, written out);
and a `with ...main_process_first():` block (Accelerate, HF Trainer).
Lightning's prepare_data hook runs on one process per node.
"""

import os

import torch.distributed as dist
from accelerate import Accelerator
from torchvision import datasets


def rank_zero_first(rank: int):
    if rank == 0:
        datasets.MNIST("./data", download=True)
    dist.barrier()
    return datasets.MNIST("./data", download=True)


def others_wait_first(local_rank: int):
    if local_rank not in (-1, 0):
        dist.barrier()
    train = datasets.FashionMNIST("./data", download=True)
    if local_rank == 0:
        dist.barrier()
    return train


def main_first(accelerator: Accelerator):
    with accelerator.main_process_first():
        return datasets.KMNIST("./data", download=True)


class DataModule:
    def prepare_data(self) -> None:
        datasets.EMNIST("./data", split="letters", download=True)


def main() -> None:
    dist.init_process_group("gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank_zero_first(dist.get_rank())
    others_wait_first(local_rank)
    main_first(Accelerator())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
