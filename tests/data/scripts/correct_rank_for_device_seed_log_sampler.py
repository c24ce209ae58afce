"""A correct script that uses the rank everywhere except in a collective's shapes.

The rank places the model and tensors, seeds the generator, labels log lines,
configures the sampler and slices the dataset; tensors handed to collectives
carry the rank in their values only, the gather list exists on the root only,
and a per-rank length is agreed on with an all_reduce before it sizes a buffer.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1234 + rank)
    print(f"[rank {rank}] starting on {device}")

    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    shard = torch.arange(64)[rank::world_size]
    print(f"[rank {rank}] {len(shard)} examples of my own")
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(torch.nn.Linear(8, 1).to(device))

    seen = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        seen += x.shape[0]
    dist.all_reduce(seen)

    ranks = torch.tensor([rank], device=device)
    everyone = [torch.zeros_like(ranks) for _ in range(world_size)]
    dist.all_gather(everyone, ranks)

    total = torch.tensor([float(rank)], device=device)
    gather_list = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None
    dist.gather(total, gather_list, dst=0)

    length = torch.tensor([len(shard)])
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    padded = torch.zeros(int(length.item()))
    dist.all_reduce(padded)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
