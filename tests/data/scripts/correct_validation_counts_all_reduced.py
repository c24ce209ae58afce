"""The counts are all-reduced before the accuracy is computed (no finding expected).

Under torchrun with 2 ranks both print the accuracy over all 8 items, 0.375.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

RIGHT = {0, 2, 4}


@torch.no_grad()
def evaluate(loader: DataLoader) -> float:
    correct, total = torch.zeros(()), torch.zeros(())
    for (index,) in loader:
        correct += sum(int(i) in RIGHT for i in index)
        total += len(index)
    for count in (correct, total):
        dist.all_reduce(count)
    return (correct / total).item()


def main() -> None:
    dist.init_process_group("gloo")
    items = TensorDataset(torch.arange(8))
    val_loader = DataLoader(items, batch_size=2, sampler=DistributedSampler(items, shuffle=False))
    accuracy = evaluate(val_loader)
    print(f"val acc {accuracy:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
