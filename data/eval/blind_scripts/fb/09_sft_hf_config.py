#!/usr/bin/env python
"""SFT loop without the HF Trainer: plain DeepSpeed engine, same ds_config style as our Trainer runs.

deepspeed --num_gpus 8 sft_hf_config.py --model_name Qwen/Qwen2-1.5B --dataset data/sft_mix_v4 \
    --output_dir out/qwen2-1.5b-sft --per_device_train_batch_size 8 --gradient_accumulation_steps 2
"""
import argparse
import copy
import json
import logging
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

logger = logging.getLogger(__name__)

# shared with the Trainer-based recipes (configs/ds_zero2.json)
DEFAULT_DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--ds_config", default=None, help="optional json; defaults to DEFAULT_DS_CONFIG")
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=2e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_epsilon", type=float, default=1e-8)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--bf16", action="store_true", default=True)
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--save_steps", type=int, default=1000)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def fill_auto_values(cfg, args, world_size):
    """Replace the Trainer-style "auto" placeholders with values from the CLI."""
    cfg = copy.deepcopy(cfg)
    cfg["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    cfg["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    cfg["train_batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    cfg["gradient_clipping"] = args.max_grad_norm
    cfg["bf16"]["enabled"] = args.bf16
    opt = cfg["optimizer"]["params"]
    opt["lr"] = args.learning_rate
    opt["betas"] = [args.adam_beta1, args.adam_beta2]
    opt["eps"] = args.adam_epsilon
    opt["weight_decay"] = args.weight_decay
    return cfg


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    ds = load_from_disk(args.dataset)
    train_ds = ds["train"].select_columns(["input_ids", "attention_mask", "labels"])
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=8)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, sampler=sampler,
                        collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)

    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    max_steps = steps_per_epoch * args.num_train_epochs
    warmup_steps = int(max_steps * args.warmup_ratio)

    if args.ds_config:
        with open(args.ds_config) as f:
            base_cfg = json.load(f)
    else:
        base_cfg = DEFAULT_DS_CONFIG
    ds_config = fill_auto_values(base_cfg, args, world_size)
    logger.info("max_steps=%d warmup_steps=%d ds_config=%s", max_steps, warmup_steps, json.dumps(ds_config))

    model = AutoModelForCausalLM.from_pretrained(
        args.model_name, torch_dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    model.config.use_cache = False

    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )

    global_step = 0
    for epoch in range(args.num_train_epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for batch in loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue
            global_step += 1
            if global_step % args.logging_steps == 0:
                logger.info({"loss": round(loss.item(), 4), "learning_rate": lr_scheduler.get_last_lr()[0],
                             "epoch": round(epoch + global_step / max_steps, 2), "step": global_step})
            if global_step % args.save_steps == 0:
                engine.save_checkpoint(args.output_dir, tag=f"checkpoint-{global_step}")

    final_dir = os.path.join(args.output_dir, "final")
    engine.save_16bit_model(final_dir, "pytorch_model.bin")
    if rank == 0:
        tokenizer.save_pretrained(final_dir)
        model.config.save_pretrained(final_dir)
        with open(os.path.join(final_dir, "ds_config.json"), "w") as f:
            json.dump(ds_config, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
