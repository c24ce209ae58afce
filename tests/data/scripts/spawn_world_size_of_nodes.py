"""The ImageNet example's launch, with the world size left as the number of nodes.

`python spawn_world_size_of_nodes.py --dist-url tcp://127.0.0.1:PORT --world-size 1
--rank 0` spawns one process per GPU (two CPU processes here) and counts each
one's global rank as node rank * processes per node + index, but hands
init_process_group --world-size unchanged: one node, so world_size=1, and the
process with rank 1 is outside the world (gloo: "rank < size"; a rendezvous
that waits for ranks that cannot join elsewhere).
"""

import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

parser = argparse.ArgumentParser()
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")


def main_worker(gpu, ngpus_per_node, args):
    args.rank = args.rank * ngpus_per_node + gpu
    dist.init_process_group(
        "gloo", init_method=args.dist_url, world_size=args.world_size, rank=args.rank  # expect: world-size-mismatch
    )
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {args.rank} of {dist.get_world_size()}: {int(total.item())} processes")
    dist.destroy_process_group()


def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count() or 2  # two CPU processes where there is no GPU
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


if __name__ == "__main__":
    main()
