"""The second node of a two-node job; MASTER_ADDR names the first node."""

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(t.item())


if __name__ == "__main__":
    main()
