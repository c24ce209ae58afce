"""The fix of model_cast_to_half_under_a_grad_scaler.py: float32 weights, float16
ops under autocast, the GradScaler's steps (no finding expected).

Runs under torchrun: the scaler unscales float32 gradients.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 8)).float().pow(2).mean()
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
