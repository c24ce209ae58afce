"""A DDP training loop under float16 autocast with a plain backward and no loss
scaler (mixed-precision-dtype).

Nothing fails: gradients below float16's smallest value become zero, large ones
inf, and the run trains worse than in float32 or bfloat16.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    model = DDP(nn.Linear(8, 1).to(device), device_ids=[device])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16
    for _ in range(4):
        with torch.autocast("cuda", dtype=dtype):  # expect: mixed-precision-dtype
            loss = model(torch.randn(2, 8, device=device)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
