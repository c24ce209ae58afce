#!/usr/bin/env python
"""LoRA fine-tuning for long-context contract review, sharded with FSDP.

Base weights are frozen and sharded; only LoRA matrices train (use_orig_params=True so
frozen and trainable parameters can share a flat parameter).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        11_lora_fsdp_longctx.py --model meta-llama/Meta-Llama-3.1-8B \
        --data /shared/contracts --out /shared/runs/contracts-lora
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
    BackwardPrefetch,
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
    ap.add_argument("--model", default="meta-llama/Meta-Llama-3.1-8B")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq_len", type=int, default=16384)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--save_every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


class ContractDataset(Dataset):
    def __init__(self, path, tok, seq_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                p = tok(f"Contract:\n{ex['contract']}\n\nReview the contract and list the risks.\n\nRisks:\n")["input_ids"]
                r = tok(ex["review"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                p = p[: max(0, seq_len - len(r))]
                ids = (p + r)[:seq_len]
                self.rows.append((ids, ([-100] * len(p) + r)[:seq_len]))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(batch, pad_id):
    n = max(len(x) for x, _ in batch)
    ids = torch.tensor([x + [pad_id] * (n - len(x)) for x, _ in batch])
    lab = torch.tensor([y + [-100] * (n - len(y)) for _, y in batch])
    att = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x, _ in batch])
    return {"input_ids": ids, "attention_mask": att, "labels": lab}


def save_lora(model, peft_model, out_dir, rank):
    # every rank takes part in gathering the full state dict; only rank 0 receives it
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        full_sd = model.state_dict()
    if rank == 0:
        # save_pretrained filters the LoRA entries out of the full state dict
        peft_model.save_pretrained(out_dir, state_dict=full_sd)
    dist.barrier()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        loss = model(**b).loss
        n = (b["labels"][:, 1:] != -100).sum()
        s[0] += loss.float() * n
        s[1] += n
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = "<|finetune_right_pad_id|>"

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    peft_model = get_peft_model(model, LoraConfig(
        r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))

    fsdp_model = FSDP(
        peft_model,
        auto_wrap_policy=fsdp_auto_wrap_policy(peft_model),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
        sync_module_states=True,  # LoRA init is random; take rank 0's copy everywhere
        use_orig_params=True,
    )

    pad = tok.pad_token_id
    train_ds = ContractDataset(os.path.join(args.data, "train.jsonl"), tok, args.seq_len)
    val_ds = ContractDataset(os.path.join(args.data, "val.jsonl"), tok, args.seq_len)
    val_ds.rows = val_ds.rows[: (len(val_ds.rows) // world) * world]
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=train_sampler,
                          collate_fn=functools.partial(collate, pad_id=pad), num_workers=2)
    val_dl = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=functools.partial(collate, pad_id=pad))

    optim = torch.optim.AdamW([p for p in fsdp_model.parameters() if p.requires_grad],
                              lr=args.lr, weight_decay=0.0)
    updates = math.ceil(len(train_dl) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(0.05 * updates), updates)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} updates={updates} tokens/update<={args.seq_len * args.accum * world}")

    upd = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        fsdp_model.train()
        t0 = time.time()
        for i, b in enumerate(train_dl):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            loss = fsdp_model(**b).loss / args.accum
            loss.backward()
            if (i + 1) % args.accum != 0 and (i + 1) != len(train_dl):
                continue
            gn = fsdp_model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            upd += 1
            if upd % 5 == 0:
                stats = torch.stack([loss.detach().float() * args.accum, gn.float()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} upd {upd}/{updates} loss {stats[0]:.4f} gnorm {stats[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 5:.1f}s/upd", flush=True)
                t0 = time.time()
            if upd % args.save_every == 0:
                save_lora(fsdp_model, peft_model, os.path.join(args.out, f"upd-{upd}"), rank)

        vl = validate(fsdp_model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

    save_lora(fsdp_model, peft_model, os.path.join(args.out, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
