"""A translation trainer that accumulates gradients until an update has seen the
paper's 25k tokens, counting the steps as if one GPU ran them: under DDP every
update averages the steps of all ranks, so with 8 GPUs it holds ~200k tokens
while the learning rate and the warm-up stay those tuned for 25k."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=3584)
    parser.add_argument("--tokens-per-update", type=int, default=25000)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    update_freq = max(1, args.tokens_per_update // args.max_tokens)  # expect: effective-batch-size-changed
    model = DDP(torch.nn.Linear(512, 512).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    for step in range(1000):
        batch = torch.randn(args.max_tokens // 64, 512, device="cuda")
        sync = (step + 1) % update_freq == 0
        if sync:
            model(batch).pow(2).mean().div(update_freq).backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            with model.no_sync():
                model(batch).pow(2).mean().div(update_freq).backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
