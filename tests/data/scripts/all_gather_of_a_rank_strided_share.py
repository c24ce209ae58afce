"""Each rank embeds its strided share of a corpus, then all_gather.

corpus[rank::world] holds one item more on the first len % world ranks, so
the embeddings differ in rows across ranks while every rank receives into
buffers shaped like its own.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn


@torch.no_grad()
def embed_corpus(encoder, corpus, rank, world, device):
    mine = corpus[rank::world]
    emb = encoder(torch.stack(mine).to(device))
    gathered = [torch.empty_like(emb) for _ in range(world)]
    dist.all_gather(gathered, emb)  # expect: collective-mismatch
    return torch.cat(gathered)


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    encoder = nn.Linear(16, 8).to(device)
    corpus = [torch.randn(16) for _ in range(1001)]
    index = embed_corpus(encoder, corpus, dist.get_rank(), dist.get_world_size(), device)
    if dist.get_rank() == 0:
        print(index.shape)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
