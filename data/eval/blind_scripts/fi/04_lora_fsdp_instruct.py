#!/usr/bin/env python
"""LoRA instruction tuning of a 13B model with FSDP (full shard, bf16).

    torchrun --nnodes=1 --nproc_per_node=8 04_lora_fsdp_instruct.py \
        --model meta-llama/Llama-2-13b-hf --train data/instruct/train.jsonl \
        --val data/instruct/val.jsonl --out runs/fsdp-lora-13b
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from peft import LoraConfig, get_peft_model
from peft.utils.other import fsdp_auto_wrap_policy


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-13b-hf")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="runs/fsdp-lora-13b")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=int, default=64)
    ap.add_argument("--save_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class JsonlSFT(Dataset):
    def __init__(self, path, tok, seq_len):
        self.items = []
        for line in open(path):
            row = json.loads(line)
            prompt = f"[INST] {row['instruction'].strip()} [/INST] "
            p = tok(prompt)["input_ids"]
            a = tok(row["response"].strip(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = (p + a)[:seq_len]
            labels = ([-100] * len(p) + a)[:seq_len]
            self.items.append((ids, labels))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids, labels = self.items[i]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    L = max(x.size(0) for x, _ in batch)
    ids = torch.full((len(batch), L), pad_id)
    lab = torch.full((len(batch), L), -100)
    att = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : x.size(0)] = x
        lab[i, : y.size(0)] = y
        att[i, : x.size(0)] = 1
    return {"input_ids": ids, "attention_mask": att, "labels": lab}


def save_adapter(model, peft_model, out_dir, rank):
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        peft_model.save_pretrained(out_dir, state_dict=state)
        print(f"saved adapter to {out_dir}", flush=True)
    dist.barrier()


@torch.no_grad()
def validate(model, loader, local_rank):
    model.eval()
    acc = torch.zeros(2, device=local_rank)
    for batch in loader:
        batch = {k: v.cuda(local_rank) for k, v in batch.items()}
        loss = model(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        acc[0] += loss.float() * n
        acc[1] += n
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 low_cpu_mem_usage=True)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.05,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    if rank == 0:
        peft_model.print_trainable_parameters()

    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                          buffer_dtype=torch.bfloat16)
    model = FSDP(
        peft_model,
        auto_wrap_policy=fsdp_auto_wrap_policy(peft_model),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=bf16,
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        use_orig_params=True,
        limit_all_gathers=True,
    )

    train_ds = JsonlSFT(args.train, tok, args.seq_len)
    val_ds = JsonlSFT(args.val, tok, args.seq_len)
    # trim so every rank sees the same number of validation batches without padded repeats
    val_ds.items = val_ds.items[: len(val_ds.items) // (world * args.micro_bs) * (world * args.micro_bs)]
    col = functools.partial(collate, pad_id=tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, rank=rank, num_replicas=world, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, rank=rank, num_replicas=world, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler, collate_fn=col,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_bs, sampler=val_sampler, collate_fn=col)

    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                              betas=(0.9, 0.95), weight_decay=0.0)
    total_steps = len(train_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, max(1, total_steps // 50), total_steps)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for batch in train_dl:
            batch = {k: v.cuda(local_rank, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total_steps} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - tic) / 10:.2f}s/it", flush=True)
                tic = time.time()

            if step % args.save_every == 0:
                save_adapter(model, peft_model, os.path.join(args.out, f"step-{step}"), rank)

        val_loss = validate(model, val_dl, local_rank)
        if rank == 0:
            print(f"epoch {epoch} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)

    save_adapter(model, peft_model, os.path.join(args.out, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
