"""The trainer of spawn_object_holding_a_lambda.py with the fix: the collate
function is a module-level function bound with functools.partial, which
pickle sends by reference, so the spawned processes start."""

import functools
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def pad_rows(rows, width):
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])


class RowData:
    def __init__(self, width):
        self.rows = [torch.randn(n % width + 1) for n in range(32)]
        self.collate = functools.partial(pad_rows, width=width)


def worker(rank, world_size, data):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    batch = data.collate(data.rows[rank::world_size])
    total = torch.tensor([float(batch.shape[0])])
    dist.all_reduce(total)
    print(f"trained rank {rank} on {int(total.item())} rows")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    mp.spawn(worker, args=(2, RowData(8)), nprocs=2)
