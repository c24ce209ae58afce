"""A DeepSpeed config that fixes all three batch sizes: it fits 16 GPUs, and the
launch below starts 8, so deepspeed.initialize stops on its batch-size assertion.

    deepspeed --num_gpus 8 deepspeed_batch_sizes_fit_another_world_size.py --micro_batch 8
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
        "train_batch_size": 512,  # expect: deepspeed-config-mismatch
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    # an evaluation config whose sizes fit no world size at all
    eval_config = {
        "train_batch_size": 100,  # expect: deepspeed-config-mismatch
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
    }
    model = nn.Linear(8, 1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(10):
        loss = engine(torch.randn(args.micro_batch, 8, device=engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    print(eval_config)


if __name__ == "__main__":
    main()
