"""A resumable loop that tells its DistributedSampler the epoch once, before the
epoch loop (to line up with the resumed epoch), and never again: every epoch
after it replays the same order on every rank.

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
    sampler.set_epoch(start_epoch)  # expect: sampler-set-epoch
    orders = []
    for epoch in range(start_epoch, start_epoch + 3):
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
