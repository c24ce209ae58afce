#!/usr/bin/env python
# Fine-tune a causal LM with PyTorch FSDP, parameters offloaded to host memory.
#   torchrun --nproc_per_node=4 02_fsdp_cpu_offload_lm.py --model meta-llama/Llama-2-7b-hf
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    CPUOffload,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--dataset", default="tatsu-lab/alpaca")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--warmup_ratio", type=float, default=0.03)
    ap.add_argument("--out", default="checkpoints/llama-fsdp-offload")
    ap.add_argument("--log_every", type=int, default=10)
    return ap.parse_args()


def format_example(ex):
    if ex.get("input"):
        prompt = f"### Instruction:\n{ex['instruction']}\n\n### Input:\n{ex['input']}\n\n### Response:\n"
    else:
        prompt = f"### Instruction:\n{ex['instruction']}\n\n### Response:\n"
    return {"text": prompt + ex["output"]}


def build_data(args, tokenizer, rank, world_size):
    ds = load_dataset(args.dataset, split="train")
    ds = ds.map(format_example, remove_columns=ds.column_names)

    def tok(batch):
        out = tokenizer(batch["text"], truncation=True, max_length=args.max_len)
        return out

    ds = ds.map(tok, batched=True, remove_columns=["text"])
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=8)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                        num_workers=4, pin_memory=True)
    return loader, sampler


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def save_full(model, tokenizer, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        tokenizer.save_pretrained(path)
        print(f"saved {path}", flush=True)
    dist.barrier()


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.eos_token

    # rank 0 loads the real weights, the rest build on meta and receive them via sync_module_states
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={LlamaDecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        buffer_dtype=torch.bfloat16)

    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        cpu_offload=CPUOffload(offload_params=True),
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=torch.device("cuda"), recurse=False)) if rank != 0 else None,
        limit_all_gathers=True,
        use_orig_params=False,
    )

    ckpt_fn = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=ckpt_fn,
                                   check_fn=lambda m: isinstance(m, LlamaDecoderLayer))

    loader, sampler = build_data(args, tokenizer, rank, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(loader) // args.grad_accum
    warmup = int(args.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, warmup, total_steps))

    device = torch.device("cuda", local_rank)
    step = 0
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        t0 = time.time()
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            is_update = (i + 1) % args.grad_accum == 0
            if not is_update:
                with model.no_sync():
                    loss = model(**batch).loss / args.grad_accum
                    loss.backward()
            else:
                loss = model(**batch).loss / args.grad_accum
                loss.backward()
                model.clip_grad_norm_(1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1

            running[0] += loss.detach().float() * args.grad_accum
            running[1] += 1
            if is_update and step % args.log_every == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total_steps} "
                          f"loss {(running[0] / running[1]).item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / args.log_every:.2f}s/it", flush=True)
                running.zero_()
                t0 = time.time()

        save_full(model, tokenizer, os.path.join(args.out, f"epoch{epoch}"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
