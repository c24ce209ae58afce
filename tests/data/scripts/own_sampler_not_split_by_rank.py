"""A P x K identity sampler of the script's own (P identities, K samples each per
batch, as re-id and metric-learning trainers use) that never splits by rank.

Every rank iterates every index of the dataset: N ranks do N times the work, and
with one seed on every rank they train on the same batches. Each rank prints
how many of the 128 samples it read.
torchrun --nproc_per_node=2 own_sampler_not_split_by_rank.py
"""

import random
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset


class IdentitySampler(Sampler):
    """Batches of `identities` identities with `instances` samples each."""

    def __init__(self, labels, identities, instances, seed=0):
        self.by_identity = defaultdict(list)
        for index, label in enumerate(labels):
            self.by_identity[label].append(index)
        self.identities, self.instances, self.seed = identities, instances, seed

    def __iter__(self):
        order = list(self.by_identity)
        random.Random(self.seed).shuffle(order)
        for label in order:
            yield from self.by_identity[label][: self.instances]

    def __len__(self):
        return sum(min(len(v), self.instances) for v in self.by_identity.values())


def main() -> None:
    dist.init_process_group("gloo")
    labels = [i // 4 for i in range(128)]
    data = TensorDataset(torch.arange(128, dtype=torch.float32).unsqueeze(1))
    sampler = IdentitySampler(labels, identities=4, instances=4)
    loader = DataLoader(data, batch_size=16, sampler=sampler)  # expect: missing-distributed-sampler
    model = DDP(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    seen = []
    for (inputs,) in loader:
        seen += inputs[:, 0].int().tolist()
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"[rank {dist.get_rank()}] read {len(seen)} of 128", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
