"""Balanced accuracy whose per-class counts have one row per class this rank saw.

Each rank evaluates its own share of the validation set and keeps
[hits, total] per class in a dict filled from the labels it met; the tensor
it all-reduces has one row per key of that dict. A class that one rank's
share lacks makes the tensors differ in length: gloo aborts ("Received data
size doesn't match expected size"), NCCL hangs or reads past the buffer, and
where the lengths happen to agree the rows of different classes are summed.
With two ranks, rank 0 sees classes 0 and 2, rank 1 classes 0, 1 and 3.
"""

import datetime
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


@torch.no_grad()
def balanced_accuracy(model, loader):
    per_class = defaultdict(lambda: [0, 0])  # class -> [hits, total]
    for x, y in loader:
        pred = model(x).argmax(1)
        for t, p in zip(y.tolist(), pred.tolist()):
            per_class[t][0] += int(t == p)
            per_class[t][1] += 1
    classes = sorted(per_class)
    counts = torch.tensor([per_class[c] for c in classes], dtype=torch.float64)
    dist.all_reduce(counts)  # expect: collective-mismatch
    recall = counts[:, 0] / counts[:, 1].clamp(min=1)
    return recall.mean().item()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0])  # class 3 once: rank 1's share
    data = TensorDataset(torch.nn.functional.one_hot(labels, 4).float(), labels)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=False))
    score = balanced_accuracy(torch.nn.Identity(), loader)
    print(f"rank {dist.get_rank()} balanced accuracy {score:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
