"""A DistributedSampler built anew every epoch with seed=base_seed + epoch (no
finding expected): each epoch has an order of its own without set_epoch.

torchrun --nproc_per_node=2 correct_sampler_reseeded_each_epoch.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    dist.init_process_group("gloo")
    base_seed = 1234
    samples = torch.arange(64, dtype=torch.float32).unsqueeze(1)
    data = TensorDataset(samples, torch.randn(64, 1))
    model = DDP(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    orders = []
    for epoch in range(3):
        sampler = DistributedSampler(data, shuffle=True, seed=base_seed + epoch)
        loader = DataLoader(data, batch_size=8, sampler=sampler)
        order = []
        for inputs, targets in loader:
            order += inputs[:, 0].int().tolist()
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        orders.append(tuple(order))
    # Every epoch's order differs from the others', as set_epoch would have made it.
    assert len(set(orders)) == len(orders), orders
    print(f"[rank {dist.get_rank()}] {len(orders)} epochs, {len(set(orders))} orders", flush=True)
    dist.barrier()  # both ranks done before gloo tears down (a rank aborted there under load)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
