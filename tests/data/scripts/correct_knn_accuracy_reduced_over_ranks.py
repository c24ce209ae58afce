"""A kNN monitor scores each rank's DistributedSampler share of the test set
(labels picked with Tensor.gather), then sums the counts of every rank with
all_reduce before rank 0 prints the accuracy."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


@torch.no_grad()
def knn_accuracy(encoder, bank, bank_labels, loader, device, k=20):
    correct, total = 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        sim = F.normalize(encoder(x), dim=1) @ bank
        _, idx = sim.topk(k, dim=-1)
        neighbours = torch.gather(bank_labels.expand(x.size(0), -1), -1, idx)
        pred = neighbours.mode(dim=-1).values
        correct += (pred == y).sum().item()
        total += y.size(0)
    counts = torch.tensor([correct, total], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    return 100.0 * (counts[0] / counts[1]).item()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    encoder = torch.nn.Linear(64, 32).to(device)
    bank = F.normalize(torch.randn(32, 1000, device=device), dim=0)
    bank_labels = torch.randint(0, 10, (1, 1000), device=device)
    test_set = TensorDataset(torch.randn(512, 64), torch.randint(0, 10, (512,)))
    sampler = DistributedSampler(test_set, shuffle=False)
    loader = DataLoader(test_set, batch_size=64, sampler=sampler)
    accuracy = knn_accuracy(encoder, bank, bank_labels, loader, device)
    if dist.get_rank() == 0:
        print(f"knn accuracy {accuracy:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
