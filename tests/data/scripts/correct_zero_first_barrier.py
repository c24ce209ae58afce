"""Rank 0 prepares data while the others wait, then everyone goes on (no finding expected).

Reduced from ultralytics/yolov5 utils/torch_utils.py (torch_distributed_zero_first) and
huggingface/transformers examples/run_glue.py (load_and_cache_examples): each rank
calls barrier() exactly once, in two different `if`s.
"""

import os

import torch
import torch.distributed as dist


def zero_first(local_rank: int) -> None:
    if local_rank not in [-1, 0]:
        dist.barrier()
    torch.save(torch.arange(10), "cache.pt")
    if local_rank == 0:
        dist.barrier()


def others_after(local_rank: int) -> None:
    if local_rank > 0:
        dist.barrier()
    else:
        print("rank 0 waits below")
        dist.barrier()


def main() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    if local_rank == -1 or not torch.cuda.is_available():
        print("single process")
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
    zero_first(local_rank)
    others_after(local_rank)
    if local_rank == -1 and os.environ.get("EVAL"):
        dist.barrier()  # the single-process path: no other rank to wait for
    if dist.is_initialized() and dist.get_rank() == 0:
        print("done")


if __name__ == "__main__":
    main()
