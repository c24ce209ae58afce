"""A model cast to float16 whose optimizer a GradScaler steps, under DDP
(mixed-precision-dtype).

The gradients are float16, so the first `scaler.unscale_` fails under torchrun
with "Attempting to unscale FP16 gradients"; AMP keeps float32 weights.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    model = nn.Linear(8, 1)
    model = model.half()  # expect: mixed-precision-dtype
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(4):
        loss = model(torch.randn(2, 8, dtype=torch.float16)).float().pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
