"""Chat SFT for Llama-3-8B with FSDP1 + activation checkpointing.

Prints a few sample completions at every eval so we can eyeball regressions
in the run logs.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        13_llama3_chat_sft_fsdp1.py --data /shared/sft/mix_v7.jsonl
"""
import argparse
import functools
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

SAMPLE_PROMPTS = [
    "Explain the difference between a process and a thread in two sentences.",
    "Write a haiku about gradient descent.",
    "What is the capital of Australia, and why is it not Sydney?",
]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Meta-Llama-3-8B")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/shared/ckpt/llama3-8b-sft")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--val-frac", type=float, default=0.01)
    return ap.parse_args()


class ChatData(Dataset):
    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        msgs = self.rows[i]["messages"]
        prompt_ids = self.tok.apply_chat_template(msgs[:-1], add_generation_prompt=True)
        full_ids = self.tok.apply_chat_template(msgs)
        full_ids = full_ids[: self.max_len]
        labels = [-100] * min(len(prompt_ids), len(full_ids)) + full_ids[len(prompt_ids):]
        return full_ids, labels


def collate(batch, pad_id):
    L = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(y)] = torch.tensor(y)
        mask[i, :len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def sample_completions(model, tok, device, max_new_tokens=96):
    model.eval()
    outs = []
    for p in SAMPLE_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt").to(device)
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)
        outs.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    model.train()
    return outs


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        acc += torch.stack([loss.float() * n, n.float()])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or "<|finetune_right_pad_id|>"
    with open(args.data) as f:
        rows = [json.loads(l) for l in f]
    random.Random(1234).shuffle(rows)
    n_val = max(64, int(len(rows) * args.val_frac))
    train_ds, val_ds = ChatData(rows[n_val:], tok, args.max_len), ChatData(rows[:n_val], tok, args.max_len)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    pad_id = tok.pad_token_id
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    tr_loader = DataLoader(train_ds, batch_size=args.bs, sampler=tr_sampler, num_workers=4,
                           collate_fn=lambda b: collate(b, pad_id), drop_last=True)
    va_loader = DataLoader(val_ds, batch_size=args.bs, sampler=DistributedSampler(val_ds, shuffle=False),
                           num_workers=2, collate_fn=lambda b: collate(b, pad_id))

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.epochs * len(tr_loader)
    warm = max(1, int(0.03 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in tr_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl = eval_loss(model, va_loader, device)
                samples = sample_completions(model, tok, device)
                if rank == 0:
                    print(f"[eval] step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                    for p, s in zip(SAMPLE_PROMPTS, samples):
                        print(f"  > {p}\n  < {s.strip()[:400]}", flush=True)

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(args.out, f"epoch{epoch}"))
        if rank == 0:
            print(f"saved epoch {epoch}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
