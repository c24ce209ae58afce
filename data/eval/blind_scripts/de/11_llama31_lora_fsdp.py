#!/usr/bin/env python
"""LoRA SFT of Llama-3.1-8B-Instruct sharded with FSDP (use_orig_params) on one 8-GPU node.

    torchrun --standalone --nproc_per_node=8 11_llama31_lora_fsdp.py \
        --train_file data/tool_sft_train.jsonl --eval_file data/tool_sft_eval.jsonl --output_dir runs/l31-lora
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from peft.utils.other import fsdp_auto_wrap_policy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--output_dir", default="runs/l31-lora")
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--micro_bs", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--n_gen", type=int, default=4)
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


def tokenize_chat(messages, tok, max_len):
    ids = tok.apply_chat_template(messages)
    labels = [-100] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            s = len(tok.apply_chat_template(messages[:i], add_generation_prompt=True))
            e = len(tok.apply_chat_template(messages[: i + 1]))
            labels[s:e] = ids[s:e]
    return ids[:max_len], labels[:max_len]


def load(path, tok, max_len):
    out, prompts = [], []
    with open(path) as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            ids, labels = tokenize_chat(msgs, tok, max_len)
            if any(l != -100 for l in labels):
                out.append((ids, labels))
                prompts.append(msgs[:-1])
    return out, prompts


def pad_collate(batch, pad_id):
    n = max(len(i) for i, _ in batch)
    ids = torch.tensor([i + [pad_id] * (n - len(i)) for i, _ in batch])
    lab = torch.tensor([l + [-100] * (n - len(l)) for _, l in batch])
    att = torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i, _ in batch])
    return {"input_ids": ids, "labels": lab, "attention_mask": att}


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    acc = torch.zeros(2, device="cuda", dtype=torch.float64)
    for b in loader:
        b = {k: v.cuda(non_blocking=True) for k, v in b.items()}
        loss = model(**b).loss
        n = (b["labels"][:, 1:] != -100).sum()
        acc += torch.stack([loss.double() * n, n.double()])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


@torch.no_grad()
def generate_samples(model, tok, prompts):
    """All ranks run this: the root FSDP unit is unsharded, inner units all-gather in their forward."""
    model.eval()
    texts = []
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    with FSDP.summon_full_params(model, writeback=False, recurse=False):
        for msgs in prompts:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt").cuda()
            out = model.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=200,
                                        do_sample=False, eos_token_id=eot, pad_token_id=tok.pad_token_id,
                                        synced_gpus=True)
            texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    model.train()
    return texts


def save_adapter(model, tok, out_dir, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        full_sd = model.state_dict()  # collective: every rank must call it
    if rank == 0:
        # PeftModel.save_pretrained keeps only the lora_* entries of the state dict it is given
        model.module.save_pretrained(out_dir, state_dict=full_sd)
        tok.save_pretrained(out_dir)
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = "<|finetune_right_pad_id|>"
    train, _ = load(args.train_file, tok, args.max_len)
    evalset, eval_prompts = load(args.eval_file, tok, args.max_len)
    collate = functools.partial(pad_collate, pad_id=tok.pad_token_id)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.micro_bs, sampler=sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    eval_dl = DataLoader(evalset, batch_size=args.micro_bs, collate_fn=collate,
                         sampler=DistributedSampler(evalset, shuffle=False, drop_last=True))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    if rank == 0:
        model.print_trainable_parameters()

    # LoRA leaves get their own FSDP units (fp32 adapters, bf16 frozen base: one dtype per flat param)
    model = FSDP(
        model,
        auto_wrap_policy=fsdp_auto_wrap_policy(model),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    total = args.epochs * (len(train_dl) // args.grad_accum)
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, b in enumerate(train_dl):
            b = {k: v.cuda(non_blocking=True) for k, v in b.items()}
            loss = model(**b).loss / args.grad_accum
            loss.backward()
            if (i + 1) % args.grad_accum:
                continue
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach().float() * args.grad_accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}] step {step}/{total} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/step", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl = evaluate(model, eval_dl)
                samples = generate_samples(model, tok, eval_prompts[: args.n_gen])
                if rank == 0:
                    print(f"[eval] step {step} loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                    for s in samples:
                        print("   >>", s[:300].replace("\n", " "), flush=True)
                save_adapter(model, tok, os.path.join(args.output_dir, f"step-{step}"), rank)

    vl = evaluate(model, eval_dl)
    if rank == 0:
        print(f"[final] eval loss {vl:.4f}", flush=True)
    save_adapter(model, tok, os.path.join(args.output_dir, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
