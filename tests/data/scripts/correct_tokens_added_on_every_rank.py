"""Every rank adds the special tokens; rank 0 only saves the vocabulary (no finding expected).

Runs under torchrun: the embeddings agree in size and DDP's check passes.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Vocabulary:
    def __init__(self, words: list[str]) -> None:
        self.words = list(words)

    def add_special_tokens(self, tokens: list[str]) -> int:
        self.words += [t for t in tokens if t not in self.words]
        return len(tokens)

    def __len__(self) -> int:
        return len(self.words)


def setup_vocabulary(rank: int) -> Vocabulary:
    vocabulary = Vocabulary(["<pad>", "a", "b", "c"])
    vocabulary.add_special_tokens(["<tool>", "</tool>"])
    if rank == 0:
        print("saved the vocabulary", flush=True)
    return vocabulary


def main() -> None:
    dist.init_process_group("gloo")
    vocabulary = setup_vocabulary(int(os.environ["RANK"]))
    model = DDP(nn.Embedding(len(vocabulary), 8))
    model(torch.tensor([1, 2])).sum().backward()
    print("trained", flush=True)
    # DDP's reducer goes before its group: destroyed after it, with an Embedding's
    # gloo all-reduce, a rank aborted at exit ("terminate called without an
    # active exception", SIGABRT) in 2 of 30 runs here; 0 of 40 this way.
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
