"""mp.spawn with gloo: rank 1 raises; mp.spawn's wrapper never calls sys.excepthook in the child."""
import os

import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    print(f"rank {rank} ready", flush=True)
    if rank == 1:
        raise RuntimeError("loss is NaN on rank one")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    mp.spawn(worker, args=(2, free_port), nprocs=2)
# lint: no findings (the failure happens at run time; nothing in the source shows it)
