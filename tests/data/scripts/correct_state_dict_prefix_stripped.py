"""A checkpoint saved from the DDP wrapper, its "module." prefix stripped
before a plain model loads it for export (no finding expected)."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP


def export(path):
    state = torch.load(path, map_location="cpu")
    consume_prefix_in_state_dict_if_present(state, "module.")
    plain = nn.Linear(8, 2)
    plain.load_state_dict(state)
    torch.jit.script(plain).save("exported.pt")


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    if local_rank == 0:
        torch.save(model.state_dict(), "last.pt")
        export("last.pt")
    dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
