"""The same resumable loop, telling its DistributedSampler each epoch at the
start of the loop (the resumed one first): each epoch draws its own order
(no finding expected).

Runs under torchrun: each rank prints whether its epochs all saw one order.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    dist.init_process_group("gloo")
    data = TensorDataset(torch.arange(64))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    start_epoch = 2  # as read back from the checkpoint
    orders = []
    for epoch in range(start_epoch, start_epoch + 3):
        sampler.set_epoch(epoch)
        order = []
        for (batch,) in loader:
            order += batch.tolist()
        orders.append(order)
    print(f"one order for every epoch: {all(o == orders[0] for o in orders)}", flush=True)
    # No collective ran: wait until every rank is in, or rank 0 can leave while another
    # is still connecting in init_process_group ("Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
