"""A preemption handler: SIGTERM sets a flag, and the training loop saves and
leaves when it sees it. The signal reaches one process (its node was
preempted; here rank 0 gets it at step 3), which leaves alone while the other
rank's next backward waits for it in DDP's gradient all-reduce.

Runs under torchrun: rank 1's next gradient all-reduce fails, its peer gone
(on a cluster the other nodes' ranks hang there until the NCCL timeout).
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
        if _preempted:  # expect: uneven-inputs
            print(f"rank {rank} saved at step {step}", flush=True)
            break
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
