"""A DDP loop that skips a batch which runs out of GPU memory on this rank
(uneven-inputs).

The rank whose long batch ran out of memory goes on to its next batch while the
others wait in the gradient all-reduce of this step's backward: the ranks pair
their all-reduces wrong, or hang until the NCCL timeout.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("nccl")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    model = DDP(nn.Linear(8, 1).to(device), device_ids=[device])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for length in (16, 4096, 32):
        x = torch.randn(length, 8, device=device)
        try:
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
        except torch.cuda.OutOfMemoryError:  # expect: uneven-inputs
            torch.cuda.empty_cache()
            continue
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
