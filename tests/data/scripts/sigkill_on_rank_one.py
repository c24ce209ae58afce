"""Rank 1 is killed by SIGKILL (as the kernel's OOM killer does); no exception anywhere."""
import os
import signal

import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} ready", flush=True)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
# lint: no findings (the failure happens at run time; nothing in the source shows it)
