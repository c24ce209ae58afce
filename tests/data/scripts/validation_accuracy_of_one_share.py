"""Validation accuracy summed over each rank's DistributedSampler share and printed
without an all_reduce (metrics-not-reduced).

Under torchrun with 2 ranks the "model" is right on items 0, 2 and 4 of 8: rank
0 reads items 0, 2, 4, 6 and prints 0.750, rank 1 reads the odd ones and
prints 0.000, and neither is the true 0.375. Nothing fails.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

RIGHT = {0, 2, 4}


@torch.no_grad()
def evaluate(loader: DataLoader) -> float:
    correct, total = 0, 0
    for (index,) in loader:  # expect: metrics-not-reduced
        correct += sum(int(i) in RIGHT for i in index)
        total += len(index)
    return correct / total


def main() -> None:
    dist.init_process_group("gloo")
    items = TensorDataset(torch.arange(8))
    val_loader = DataLoader(items, batch_size=2, sampler=DistributedSampler(items, shuffle=False))
    accuracy = evaluate(val_loader)
    print(f"val acc {accuracy:.3f}", flush=True)
    # No collective ran: wait until every rank is in, or rank 0 can leave while another
    # is still connecting in init_process_group ("Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
