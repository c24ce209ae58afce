"""An FSDP training step that clips with torch.nn.utils.clip_grad_norm_
(zero3-partitioned-parameters).

FSDP leaves each rank the gradients of its own shard: torch's function measures
that shard's norm, so every rank clips by another factor and the logged norm is
not the model's. FSDP's own model.clip_grad_norm_() all-reduces the norms.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = FSDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).cuda())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(4):
        loss = model(torch.randn(2, 8, device="cuda")).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: zero3-partitioned-parameters
        optimizer.step()
        print(f"grad norm {norm.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
