"""Accuracy recovery for an RTN int4 model with LoRA adapters (QLoRA-style).

The base weights are group-wise int4 round-to-nearest quantized once at start
and frozen; LoRA adapters on all linear layers are trained with DDP on an
instruction mix to recover the quantization loss. Training is resumable from
the last `training_state.pt`.

torchrun --nproc_per_node=8 16_qlora_int4_recovery.py --resume_from ckpt/mistral-int4-lora/last
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, get_cosine_schedule_with_warmup


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--data", default="allenai/tulu-3-sft-mixture")
    ap.add_argument("--out", default="ckpt/mistral-int4-lora")
    ap.add_argument("--resume_from", default=None)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--r", type=int, default=64)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--save_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


@torch.no_grad()
def rtn_quantize_(model, bits, group):
    qmax = 2 ** bits - 1
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and "lm_head" not in name:
            w = m.weight.data
            o, i = w.shape
            wg = w.float().reshape(o, i // group, group)
            lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
            scale = ((hi - lo) / qmax).clamp(min=1e-6)
            zp = torch.round(-lo / scale)
            wq = (torch.clamp(torch.round(wg / scale) + zp, 0, qmax) - zp) * scale
            m.weight.data = wq.reshape(o, i).to(w.dtype)
            n += 1
    return n


def build_dataset(tok, args):
    raw = load_dataset(args.data, split="train")

    def enc(ex):
        ids = tok.apply_chat_template(ex["messages"], tokenize=True)[: args.max_len]
        prefix = tok.apply_chat_template(ex["messages"][:-1], tokenize=True, add_generation_prompt=True)
        labels = ([-100] * len(prefix) + ids[len(prefix):])[: len(ids)]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    return raw.map(enc, remove_columns=raw.column_names, num_proc=32)


def save_state(model, opt, sched, step, path):
    os.makedirs(path, exist_ok=True)
    torch.save({
        "adapter": get_peft_model_state_dict(model.module),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": step,
    }, os.path.join(path, "training_state.pt"))
    model.module.save_pretrained(path)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token
    if rank != 0:
        dist.barrier()
    ds = build_dataset(tok, args)
    if rank == 0:
        dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 device_map={"": local_rank})
    n_q = rtn_quantize_(model, args.bits, args.group)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lcfg = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lcfg)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4,
                        collate_fn=DataCollatorForSeq2Seq(tok, padding=True, pad_to_multiple_of=8))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, 100, args.steps)

    step = 0
    if args.resume_from:
        state = torch.load(os.path.join(args.resume_from, "training_state.pt"))
        set_peft_model_state_dict(model.module, state["adapter"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {args.resume_from} at step {step}", flush=True)

    if rank == 0:
        n_train = sum(p.numel() for p in params)
        print(f"RTN-quantized {n_q} linears to int{args.bits} g{args.group}; "
              f"{n_train / 1e6:.1f}M trainable LoRA params", flush=True)

    epoch = step // len(loader)
    skip = step % len(loader)
    t0 = time.time()
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if skip:
                skip -= 1
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.3)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.save_every == 0 or step == args.steps:
                if rank == 0:
                    save_state(model, opt, sched, step, os.path.join(args.out, "last"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
