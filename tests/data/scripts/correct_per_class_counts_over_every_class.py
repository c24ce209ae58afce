"""Balanced accuracy with one row per class of the whole label set.

The twin of all_reduce_of_the_classes_each_rank_saw.py: the counts tensor is
sized by the number of classes, not by the classes this rank's share held,
so every rank reduces the same shape and row c is class c everywhere; a
class a rank never saw adds zeros. Both ranks print the same score.
"""

import datetime

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

NUM_CLASSES = 4


@torch.no_grad()
def balanced_accuracy(model, loader, num_classes):
    counts = torch.zeros(num_classes, 2, dtype=torch.float64)  # class -> [hits, total]
    for x, y in loader:
        pred = model(x).argmax(1)
        for t, p in zip(y.tolist(), pred.tolist()):
            counts[t, 0] += int(t == p)
            counts[t, 1] += 1
    dist.all_reduce(counts)
    seen = counts[:, 1] > 0
    return (counts[seen, 0] / counts[seen, 1]).mean().item()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0])
    data = TensorDataset(torch.nn.functional.one_hot(labels, NUM_CLASSES).float(), labels)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=False))
    score = balanced_accuracy(torch.nn.Identity(), loader, NUM_CLASSES)
    print(f"rank {dist.get_rank()} balanced accuracy {score:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
