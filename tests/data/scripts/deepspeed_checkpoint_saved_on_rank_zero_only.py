"""A DeepSpeed engine's checkpoint saved under `if rank == 0:`, the DDP way of saving.

engine.save_checkpoint() is a collective: every rank writes its own partition
of the optimizer state and they synchronise, so rank 0 waits for ranks that
went on to the next epoch. DeepSpeed writes the shared files from rank 0
itself; the call belongs on every rank. Lint only (DeepSpeed is not installed
here).
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    model = nn.Linear(16, 2)
    model_engine, _optimizer, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    for epoch in range(3):
        for _step in range(10):
            loss = model_engine(torch.randn(8, 16).to(model_engine.device)).sum()
            model_engine.backward(loss)
            model_engine.step()
        if dist.get_rank() == 0:
            model_engine.save_checkpoint("checkpoints", tag=f"epoch{epoch}")  # expect: collective-mismatch


if __name__ == "__main__":
    main()
