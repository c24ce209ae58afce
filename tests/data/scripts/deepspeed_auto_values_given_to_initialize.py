"""Supervised fine-tuning with the DeepSpeed engine itself, with a config copied
from a Hugging Face Trainer template.

    deepspeed --num_gpus 4 deepspeed_auto_values_given_to_initialize.py

The script fills the batch sizes, but the optimizer's lr and weight_decay and
bf16.enabled stay "auto": only the Trainer and Accelerate fill those in, and
deepspeed.initialize cannot build an AdamW whose learning rate is "auto".
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
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
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
    engine, _, _, _ = deepspeed.initialize(  # expect: deepspeed-config-mismatch
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    engine.train()


if __name__ == "__main__":
    main()
