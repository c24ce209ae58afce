"""One Slurm task per GPU on four nodes, the env:// variables filled in from
srun's: MASTER_ADDR defaults to the task's own host name, so the tasks of each
node rendezvous with a store on their own machine and the nodes never meet.

    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=4
    srun python train.py
"""

import os
import socket

import torch
import torch.distributed as dist


def slurm_env() -> None:
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ.setdefault("MASTER_ADDR", socket.gethostname())  # expect: master-endpoint-mismatch
    os.environ.setdefault("MASTER_PORT", "29500")


def main() -> None:
    slurm_env()
    torch.cuda.set_device(int(os.environ["SLURM_LOCALID"]))
    dist.init_process_group("nccl")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
