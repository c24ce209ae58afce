"""The fix of deepspeed_batch_sizes_fit_another_world_size.py (no finding expected):
the three batch sizes fit the launch's 8 GPUs, and a second config leaves the
total out so DeepSpeed computes it for any world size.

    deepspeed --num_gpus 8 correct_deepspeed_batch_sizes_fit_the_launch.py --micro_batch 8
"""

import argparse

import deepspeed
import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    config = {
        "train_batch_size": 256,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "bf16": {"enabled": True},
    }
    portable = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
    }
    model = nn.Linear(8, 1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(10):
        loss = engine(torch.randn(args.micro_batch, 8, device=engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    print(portable)


if __name__ == "__main__":
    main()
