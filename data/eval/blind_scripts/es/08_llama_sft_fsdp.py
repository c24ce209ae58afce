"""Supervised fine-tuning of a Llama-style model on instruction data, FSDP through accelerate.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 08_llama_sft_fsdp.py \
        --model meta-llama/Llama-3.2-3B --data data/sft_mix.jsonl --out runs/llama3b_sft
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.distributed.fsdp import FullStateDictConfig, FullOptimStateDictConfig, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

IGNORE_INDEX = -100
PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.2-3B")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--micro_bs", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--save_every", type=int, default=500)
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


def build_example(rec, tokenizer, max_len):
    prompt = PROMPT.format(instruction=rec["instruction"], input=rec.get("input", ""))
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    answer_ids = tokenizer(rec["output"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + answer_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[:max_len]
    return {"input_ids": input_ids, "labels": labels}


def collate(batch, pad_id):
    width = max(len(b["input_ids"]) for b in batch)
    width = int(math.ceil(width / 64) * 64)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.tensor(b["input_ids"])
        labels[i, :n] = torch.tensor(b["labels"])
        attn[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attn}


def main():
    args = parse_args()
    fsdp_plugin = FullyShardedDataParallelPlugin(
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={LlamaDecoderLayer}),
        state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
        limit_all_gathers=True,
        use_orig_params=True,
    )
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, fsdp_plugin=fsdp_plugin)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    raw = load_dataset("json", data_files=args.data, split="train")
    with accelerator.main_process_first():
        ds = raw.map(lambda r: build_example(r, tokenizer, args.max_len),
                     remove_columns=raw.column_names, num_proc=16, desc="tokenize")
        ds = ds.train_test_split(test_size=0.01, seed=args.seed)
    train_loader = DataLoader(ds["train"], batch_size=args.micro_bs, shuffle=True,
                              collate_fn=lambda b: collate(b, tokenizer.pad_token_id), num_workers=2)
    eval_loader = DataLoader(ds["test"], batch_size=args.micro_bs,
                             collate_fn=lambda b: collate(b, tokenizer.pad_token_id), num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    # with FSDP the model is wrapped before the optimizer sees its parameters
    model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        optimizer, train_loader, eval_loader, scheduler
    )

    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "run_config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    accelerator.print(f"world={dist.get_world_size()} train={len(ds['train'])} eval={len(ds['test'])} "
                      f"steps/epoch={math.ceil(len(train_loader) / args.grad_accum)}")

    step = 0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        acc_loss = torch.zeros((), device=accelerator.device)
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                acc_loss += loss.detach() / args.grad_accum
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 10 == 0:
                    mean_loss = accelerator.reduce(acc_loss, reduction="mean").item()
                    accelerator.print(f"epoch {epoch} step {step} loss {mean_loss:.4f} "
                                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - tic) / 10:.2f}s/step")
                    tic = time.time()
                acc_loss.zero_()
                if step % args.save_every == 0:
                    accelerator.save_state(os.path.join(args.out, f"state_{step}"))

        model.eval()
        losses = []
        for batch in eval_loader:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].size(0))))
        eval_loss = torch.cat(losses).mean().item()
        accelerator.print(f"epoch {epoch} eval loss {eval_loss:.4f} ppl {math.exp(eval_loss):.2f}")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state_dict = accelerator.get_state_dict(model)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(os.path.join(args.out, "final"), state_dict=state_dict,
                                  safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(args.out, "final"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
