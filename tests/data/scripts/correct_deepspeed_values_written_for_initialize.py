"""Supervised fine-tuning with the DeepSpeed engine itself, with a config copied
from a Hugging Face Trainer template.

    deepspeed --num_gpus 4 correct_deepspeed_values_written_for_initialize.py

The batch sizes are filled in by the script and every other "auto" of the
template is written as a value: DeepSpeed reads each as it is.
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

DS_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.0}},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro-bsz", type=int, default=4)
    parser.add_argument("--accum", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed()
    ds_config = dict(DS_CONFIG)
    ds_config["train_micro_batch_size_per_gpu"] = args.micro_bsz
    ds_config["gradient_accumulation_steps"] = args.accum
    ds_config["train_batch_size"] = args.micro_bsz * args.accum * dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained("gpt2", torch_dtype=torch.bfloat16)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    engine.train()


if __name__ == "__main__":
    main()
