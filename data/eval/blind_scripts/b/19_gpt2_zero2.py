"""
GPT-2 medium instruction fine-tuning with DeepSpeed ZeRO-2 (bf16), JSONL data:
{"prompt": "...", "response": "..."} per line.

    deepspeed --num_gpus 8 19_gpt2_zero2.py --train_file data/train.jsonl --eval_file data/eval.jsonl
"""
import argparse
import json
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--eval_file", required=True)
    parser.add_argument("--output_dir", default="out/gpt2-sft")
    parser.add_argument("--max_len", type=int, default=512)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup_ratio", type=float, default=0.03)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.samples = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                prompt_ids = tokenizer(ex["prompt"] + "\n\n")["input_ids"]
                resp_ids = tokenizer(ex["response"] + tokenizer.eos_token)["input_ids"]
                ids = (prompt_ids + resp_ids)[:max_len]
                labels = ([-100] * len(prompt_ids) + resp_ids)[:max_len]
                self.samples.append((ids, labels))
        self.pad_id = tokenizer.pad_token_id
        self.max_len = max_len

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        ids, labels = self.samples[i]
        pad = self.max_len - len(ids)
        return {
            "input_ids": torch.tensor(ids + [self.pad_id] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
            "labels": torch.tensor(labels + [-100] * pad),
        }


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    get_accelerator().set_device(local_rank)
    device = torch.device(get_accelerator().device_name(), local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False

    train_ds = SFTDataset(args.train_file, tokenizer, args.max_len)
    eval_ds = SFTDataset(args.eval_file, tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    eval_sampler = DistributedSampler(eval_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.micro_batch, sampler=eval_sampler, num_workers=2)

    total_steps = args.epochs * len(train_loader) // args.grad_accum
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"total_num_steps": total_steps, "warmup_min_lr": 0,
                                 "warmup_max_lr": args.lr,
                                 "warmup_num_steps": int(args.warmup_ratio * total_steps)}},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }

    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config)

    def evaluate():
        engine.eval()
        loss_sum = torch.zeros(1, device=device)
        n = torch.zeros(1, device=device)
        with torch.no_grad():
            for batch in eval_loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                loss_sum += engine(**batch).loss.float()
                n += 1
        dist.all_reduce(loss_sum)
        dist.all_reduce(n)
        engine.train()
        return (loss_sum / n).item()

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            step += 1
            if rank == 0 and step % (50 * args.grad_accum) == 0:
                print(f"epoch {epoch} micro-step {step} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s")

        eval_loss = evaluate()
        if rank == 0:
            print(f"epoch {epoch}: eval loss {eval_loss:.4f} ppl {math.exp(eval_loss):.2f}")
        # every rank writes its own ZeRO shard
        engine.save_checkpoint(args.output_dir, tag=f"epoch_{epoch}")

    # plain HF weights for inference (ZeRO-2 keeps the full parameters on every rank)
    if rank == 0:
        engine.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
