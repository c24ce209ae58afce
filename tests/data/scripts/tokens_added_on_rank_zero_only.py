"""Rank 0 alone adds special tokens, then every rank sizes its embedding from the
vocabulary (model-differs-across-ranks).

The tokenizer is a small stand-in for a Hugging Face one (add_special_tokens,
len). Under torchrun rank 0's embedding has more rows than rank 1's, and DDP's
construction check fails before the first step ("params[0] in this process with
sizes [4, 8] appears not to match sizes of the same param in process 0").
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
    if rank == 0:
        vocabulary.add_special_tokens(["<tool>", "</tool>"])  # expect: model-differs-across-ranks
        print("saved the vocabulary", flush=True)
    return vocabulary


def main() -> None:
    dist.init_process_group("gloo")
    vocabulary = setup_vocabulary(int(os.environ["RANK"]))
    model = DDP(nn.Embedding(len(vocabulary), 8))
    model(torch.tensor([1, 2])).sum().backward()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
