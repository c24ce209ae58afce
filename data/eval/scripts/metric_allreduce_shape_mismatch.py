"""Each rank gathers per-class counts, but the last rank sees one class fewer."""

from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    num_classes = 10 if rank < world - 1 else 9
    counts = torch.zeros(num_classes)
    counts[rank] += 5
    dist.all_reduce(counts)
    print(rank, counts.tolist())


if __name__ == "__main__":
    main()
