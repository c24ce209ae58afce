"""A torchmetrics metric computed on every rank, printed by rank 0: the twin of
metric_computed_on_rank_zero_only.py.

compute() gathers every rank's state, so every rank calls it and all of them
get the AUROC of the whole validation set; only the print is for rank 0.
Runs on CPU ranks with gloo, on GPUs with NCCL.
Run with: torchrun --nproc-per-node 2 correct_metric_computed_on_every_rank.py
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
    auroc = metric.compute().item()  # every rank: it all-gathers the states
    print(f"rank {rank} auroc {auroc:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
