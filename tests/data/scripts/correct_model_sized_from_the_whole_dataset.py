"""Each rank reads its own files for training, but the vocabulary comes from
the whole dataset's index, the same on every rank."""

import glob
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Tagger(nn.Module):
    def __init__(self, vocab_size, tags, dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, tags)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = json.load(open("corpus/vocab.json"))
    files = sorted(glob.glob("corpus/*.jsonl"))[rank::world]
    rows = [json.loads(line) for path in files for line in open(path)]
    model = Tagger(len(vocab["words"]) + 1, len(vocab["tags"])).cuda(local_rank)
    model = DDP(model, device_ids=[local_rank])
    print(len(rows))
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
