"""Never calls set_device and moves tensors with .cuda(); a barrier follows init."""

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("nccl")
    dist.barrier()
    x = torch.randn(4).cuda()
    dist.all_reduce(x)
    print(dist.get_rank(), x)


if __name__ == "__main__":
    main()
