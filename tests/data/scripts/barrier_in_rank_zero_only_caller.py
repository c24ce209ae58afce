# Reduced from huggingface/transformers examples/run_glue.py before PR #1081: evaluation
# runs on rank 0 only and reaches the "zero first" barrier pair, whose other half the
# remaining ranks never enter.
import os

import torch
import torch.distributed as dist


def load_examples(local_rank: int) -> torch.Tensor:
    if local_rank not in [-1, 0]:
        dist.barrier()
    features = torch.arange(10)
    if local_rank == 0:
        dist.barrier()  # expect: collective-mismatch
    return features


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    load_examples(local_rank)
    if os.environ.get("DO_EVAL") and local_rank in [-1, 0]:
        load_examples(local_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
