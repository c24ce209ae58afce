"""The same P x K identity sampler, told the rank and the number of replicas: each
rank keeps every num_replicas-th identity from its rank, so the ranks split
the dataset between them. Each rank prints how many of the 128 samples it read.
torchrun --nproc_per_node=2 correct_own_sampler_split_by_rank.py
"""

import random
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset


class IdentitySampler(Sampler):
    """Batches of `identities` identities with `instances` samples each, this rank's share."""

    def __init__(self, labels, identities, instances, rank, num_replicas, seed=0):
        self.by_identity = defaultdict(list)
        for index, label in enumerate(labels):
            self.by_identity[label].append(index)
        self.identities, self.instances, self.seed = identities, instances, seed
        self.rank, self.num_replicas = rank, num_replicas

    def __iter__(self):
        order = list(self.by_identity)
        random.Random(self.seed).shuffle(order)  # the same order on every rank, then split
        for label in order[self.rank :: self.num_replicas]:
            yield from self.by_identity[label][: self.instances]

    def __len__(self):
        return sum(min(len(v), self.instances) for v in self.by_identity.values()) // self.num_replicas


def main() -> None:
    dist.init_process_group("gloo")
    labels = [i // 4 for i in range(128)]
    data = TensorDataset(torch.arange(128, dtype=torch.float32).unsqueeze(1))
    sampler = IdentitySampler(
        labels, identities=4, instances=4, rank=dist.get_rank(), num_replicas=dist.get_world_size()
    )
    loader = DataLoader(data, batch_size=16, sampler=sampler)
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
