"""Each rank reads a shard of its own, the shard's index taken from torchrun's
environment (no finding expected): neither loader needs a DistributedSampler.

torchrun --nproc_per_node=2 correct_dataset_sharded_by_env_rank.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset


def shard(dataset: TensorDataset, num_shards: int, index: int) -> Subset:
    """Samples index, index + num_shards, ...: like datasets.Dataset.shard, for a map dataset."""
    return Subset(dataset, range(index, len(dataset), num_shards))


def main() -> None:
    dist.init_process_group("gloo")
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))  # one node: the local rank is the rank
    train_set = TensorDataset(torch.arange(128, dtype=torch.float32).unsqueeze(1))
    val_set = TensorDataset(torch.arange(32, dtype=torch.float32).unsqueeze(1))
    train = shard(train_set, num_shards=world, index=int(os.environ["RANK"]))
    val = shard(val_set, num_shards=world, index=local)
    train_loader = DataLoader(train, batch_size=16, shuffle=True)
    val_loader = DataLoader(val, batch_size=8)
    model = DDP(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    seen = []
    for epoch in range(2):
        for (inputs,) in train_loader:
            seen += inputs[:, 0].int().tolist() if epoch == 0 else []
            loss = model(inputs).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        val_loss = sum(model(inputs).pow(2).mean().item() for (inputs,) in val_loader)
    everyone = [None] * world
    dist.all_gather_object(everyone, sorted(seen))
    # The shards split the training set: every sample once, on one rank.
    assert sorted(sum(everyone, [])) == list(range(128)), everyone
    print(f"[rank {dist.get_rank()}] read {len(seen)} of 128, val loss {val_loss:.3f}", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
