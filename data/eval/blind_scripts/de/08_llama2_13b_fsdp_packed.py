#!/usr/bin/env python
# Packed SFT for Llama-2-13B with FSDP.
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
#       08_llama2_13b_fsdp_packed.py --data /shared/data/sft_mix.jsonl --save_dir /shared/ckpt/llama2-13b-sft
import argparse
import functools
import json
import math
import os
from datetime import timedelta

import numpy as np
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
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

B_INST, E_INST = "[INST]", "[/INST]"


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-2-13b-hf")
    p.add_argument("--data", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--n_eval", type=int, default=500)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def encode_pair(tok, prompt, answer):
    p_ids = tok.encode(f"{B_INST} {prompt.strip()} {E_INST}", add_special_tokens=False)
    a_ids = tok.encode(f" {answer.strip()}", add_special_tokens=False)
    ids = [tok.bos_token_id] + p_ids + a_ids + [tok.eos_token_id]
    labels = [-100] * (1 + len(p_ids)) + a_ids + [tok.eos_token_id]
    return ids, labels


class PackedDataset(Dataset):
    """Greedy packing of whole examples into seq_len blocks; labels stay masked per example."""

    def __init__(self, examples, seq_len, pad_id):
        self.blocks = []
        cur_ids, cur_lab, cur_pos = [], [], []
        for ids, lab in examples:
            ids, lab = ids[:seq_len], lab[:seq_len]
            if len(cur_ids) + len(ids) > seq_len:
                self._flush(cur_ids, cur_lab, cur_pos, seq_len, pad_id)
                cur_ids, cur_lab, cur_pos = [], [], []
            cur_ids += ids
            cur_lab += lab
            cur_pos += list(range(len(ids)))
        if cur_ids:
            self._flush(cur_ids, cur_lab, cur_pos, seq_len, pad_id)

    def _flush(self, ids, lab, pos, seq_len, pad_id):
        pad = seq_len - len(ids)
        self.blocks.append((
            np.array(ids + [pad_id] * pad, dtype=np.int64),
            np.array(lab + [-100] * pad, dtype=np.int64),
            np.array(pos + [0] * pad, dtype=np.int64),
        ))

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        ids, lab, pos = self.blocks[i]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(lab),
                "position_ids": torch.from_numpy(pos)}


def lr_at(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    tot = torch.zeros(2, device="cuda")
    for batch in loader:
        batch = {k: v.cuda() for k, v in batch.items()}
        out = model(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        tot += torch.stack([out.loss.float() * n, n.float()])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def save_model(model, tok, path):
    if dist.get_rank() == 0:
        save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
            cpu_state = model.state_dict()
        os.makedirs(path, exist_ok=True)
        model.module.save_pretrained(path, state_dict=cpu_state, max_shard_size="5GB")
        tok.save_pretrained(path)
        print(f"saved {path}", flush=True)
    dist.barrier()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token

    with open(args.data) as f:
        rows = [json.loads(l) for l in f]
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]
    pairs = [encode_pair(tok, r["prompt"], r["response"]) for r in rows]
    eval_ds = PackedDataset(pairs[: args.n_eval], args.seq_len, tok.pad_token_id)
    train_ds = PackedDataset(pairs[args.n_eval:], args.seq_len, tok.pad_token_id)
    if rank == 0:
        print(f"{len(pairs)} examples -> {len(train_ds)} train blocks, {len(eval_ds)} eval blocks", flush=True)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size,
                             sampler=DistributedSampler(eval_ds, shuffle=False), num_workers=1)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        sync_module_states=False,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.epochs * len(train_loader) // args.accum

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, batch in enumerate(train_loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            (loss / args.accum).backward()
            if (i + 1) % args.accum != 0:
                continue
            for g in optim.param_groups:
                g["lr"] = lr_at(step, total, args.warmup, args.lr)
            model.clip_grad_norm_(1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f}", flush=True)

        eval_loss = evaluate(model, eval_loader)
        if rank == 0:
            print(f"epoch {epoch} eval loss {eval_loss:.4f}", flush=True)
        save_model(model, tok, os.path.join(args.save_dir, f"epoch_{epoch}"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
