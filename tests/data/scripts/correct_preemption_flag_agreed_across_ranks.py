"""The same preemption handler, with the flag agreed on: each step the ranks
all_reduce it (MAX), so all of them save and leave at the same step however
many got the signal (no finding expected).

Runs under torchrun: both ranks stop at step 3.
"""

import datetime
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_preempted = False


def _on_sigterm(signum, frame):
    global _preempted
    _preempted = True


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    signal.signal(signal.SIGTERM, _on_sigterm)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(8):
        if rank == 0 and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the preemption notice, on one node only
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stop = torch.tensor(1.0 if _preempted else 0.0)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            print(f"rank {rank} saved at step {step}", flush=True)
            break
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
