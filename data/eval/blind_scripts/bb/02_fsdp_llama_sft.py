#!/usr/bin/env python
"""Full fine-tuning of Llama with PyTorch FSDP (no Accelerate), llama-recipes style.

Only rank 0 materialises the pretrained weights on CPU; the other ranks build the
model on the meta device and receive the weights through sync_module_states.

    torchrun --standalone --nproc_per_node=8 02_fsdp_llama_sft.py \
        --model meta-llama/Llama-2-13b-hf --output_dir ckpt/llama13b-sft
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--dataset", default="HuggingFaceH4/ultrachat_200k")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_steps", type=int, default=100)
    ap.add_argument("--log_every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def chat_to_text(example, tokenizer):
    return {"text": tokenizer.apply_chat_template(example["messages"], tokenize=False)}


def pack(examples, tokenizer, seq_len):
    ids = tokenizer(examples["text"], add_special_tokens=False)["input_ids"]
    flat = [tok for seq in ids for tok in seq + [tokenizer.eos_token_id]]
    n = (len(flat) // seq_len) * seq_len
    blocks = [flat[i:i + seq_len] for i in range(0, n, seq_len)]
    return {"input_ids": blocks, "labels": [list(b) for b in blocks]}


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
        )

    # rank 0 fills the HF datasets cache first, the others then load it from disk
    if rank != 0:
        dist.barrier()
    ds = load_dataset(args.dataset, split="train_sft")
    ds = ds.map(chat_to_text, fn_kwargs={"tokenizer": tokenizer}, remove_columns=ds.column_names, num_proc=16)
    ds = ds.map(pack, batched=True, fn_kwargs={"tokenizer": tokenizer, "seq_len": args.seq_len},
                remove_columns=["text"], num_proc=16)
    if rank == 0:
        dist.barrier()

    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=default_data_collator,
                        num_workers=4, pin_memory=True, drop_last=True)

    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                     low_cpu_mem_usage=True)
    else:
        cfg = AutoConfig.from_pretrained(args.model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mp_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=torch.cuda.current_device(), recurse=False))
        if rank != 0 else None,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_lambda, warmup=args.warmup_steps, total=total_steps))

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{world_size} ranks, {len(ds)} packed blocks, {total_steps} steps", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        acc = torch.zeros(2, device="cuda")
        for batch in loader:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            out = model(**batch)
            out.loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            acc[0] += out.loss.detach().float()
            acc[1] += 1
            if step % args.log_every == 0:
                dist.all_reduce(acc)
                if rank == 0:
                    tok_s = args.log_every * args.batch_size * args.seq_len * world_size / (time.perf_counter() - t0)
                    print(f"epoch {epoch} step {step}/{total_steps} loss {(acc[0] / acc[1]).item():.4f} "
                          f"gnorm {gnorm.item():.3f} lr {scheduler.get_last_lr()[0]:.2e} tok/s {tok_s:,.0f}",
                          flush=True)
                acc.zero_()
                t0 = time.perf_counter()

        # every rank takes part in gathering the full state dict; only rank 0 receives it, on CPU
        save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
            cpu_state = model.state_dict()
        if rank == 0:
            save_dir = os.path.join(args.output_dir, f"epoch_{epoch}")
            model.module.save_pretrained(save_dir, state_dict=cpu_state, safe_serialization=True)
            tokenizer.save_pretrained(save_dir)
            print(f"saved {save_dir}", flush=True)
        del cpu_state
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
