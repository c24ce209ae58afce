"""A character tokenizer that appends <pad>, <bos> and <eos> after the corpus's
characters but counts only two of them in vocab_size: the model's embedding has
no row for <eos>, and the first sequence that ends indexes out of range (on a
GPU a device-side assert that kills the rank; on the CPU "index out of range in
self").

Linted, and checked in tests/lint/test_vocabulary_checks.py by building the
embedding the size says and looking up the id.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class CharTokenizer:
    def __init__(self, chars):
        self.chars = sorted(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.pad_id = len(self.chars)
        self.bos_id = len(self.chars) + 1
        self.eos_id = len(self.chars) + 2

    @property
    def vocab_size(self):
        return len(self.chars) + 2  # expect: device-side-assert

    def encode(self, text):
        return [self.bos_id] + [self.stoi[c] for c in text] + [self.eos_id]


def main():
    dist.init_process_group("gloo")
    tok = CharTokenizer(set("abc"))
    model = DDP(nn.Embedding(tok.vocab_size, 8))
    ids = torch.tensor([tok.encode("abc")])
    model(ids).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
