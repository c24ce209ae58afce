"""A torchmetrics metric computed on rank 0 only: compute() gathers every rank's
state (an all-gather), so rank 0 waits for ranks that never call it.

Each rank updates the metric with its own share; rank 0 alone calls compute()
to print the epoch's AUROC, while rank 1 goes on to the barrier. The two ranks
wait in different collectives until the process group's timeout.
Runs on CPU ranks with gloo, on GPUs with NCCL.
Run with: torchrun --nproc-per-node 2 metric_computed_on_rank_zero_only.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC


def main():
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    metric = BinaryAUROC().to(device)
    # Each rank's share of the validation set: scores and labels.
    preds = torch.tensor([0.1, 0.4, 0.35, 0.8], device=device) + 0.05 * rank
    target = torch.tensor([0, 0, 1, 1], device=device)
    metric.update(preds, target)
    if rank == 0:
        print(f"auroc {metric.compute().item():.3f}")  # expect: collective-mismatch
    dist.barrier()
    print(f"rank {rank} done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
