#!/usr/bin/env python
# Full fine-tune of a 7B HF causal LM with FSDP1 (FULL_SHARD, bf16).
#
# Host RAM on the training nodes is limited, so only rank 0 materialises the
# pretrained weights on CPU; the other ranks build the model on the meta device.
import argparse
import functools
import logging
import math
import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

logger = logging.getLogger("ft")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--dataset", default="/data/instruct/ultrachat_200k_tok")
    ap.add_argument("--out", default="/data/ckpt/mistral7b-ultrachat")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=float, default=0.03)
    ap.add_argument("--eval-every", type=int, default=200)
    return ap.parse_args()


def make_collate(pad_id, max_len):
    def collate(rows):
        L = min(max_len, max(len(r["input_ids"]) for r in rows))
        ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
        lab = torch.full((len(rows), L), -100, dtype=torch.long)
        att = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            n = min(L, len(r["input_ids"]))
            ids[i, :n] = torch.tensor(r["input_ids"][:n])
            lab[i, :n] = torch.tensor(r["labels"][:n])
            att[i, :n] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}
    return collate


def load_model(name, rank):
    config = AutoConfig.from_pretrained(name)
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16,
                                                     attn_implementation="sdpa")
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16,
                                                     attn_implementation="sdpa")
    return model


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        tot[0] += out.loss.float() * n
        tot[1] += n
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def save_full(model, tokenizer, out_dir, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        sd = model.state_dict()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model.module.save_pretrained(out_dir, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    model = load_model(args.model, rank)
    model.config.use_cache = False

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MistralDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        param_init_fn=(lambda m: m.to_empty(device=torch.cuda.current_device(), recurse=False))
        if rank != 0 else None,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, MistralDecoderLayer),
    )

    ds = load_dataset(args.dataset) if not os.path.isdir(args.dataset) else load_dataset(
        "parquet", data_dir=args.dataset)
    train, val = ds["train"], ds["test"]
    collate = make_collate(tokenizer.pad_token_id, args.max_len)
    tr_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    tr_loader = DataLoader(train, batch_size=args.bs, sampler=tr_sampler, collate_fn=collate,
                           num_workers=4, pin_memory=True, drop_last=True)
    va_loader = DataLoader(val, batch_size=args.bs,
                           sampler=DistributedSampler(val, num_replicas=world, rank=rank, shuffle=False),
                           collate_fn=collate, num_workers=2)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = len(tr_loader) // args.accum
    total = steps_per_epoch * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(args.warmup * total), total)
    logger.info("world=%d  steps/epoch=%d  total=%d", world, steps_per_epoch, total)

    step = 0
    model.train()
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        running = torch.zeros((), device=device)
        for i, batch in enumerate(tr_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                loss = model(**batch).loss / args.accum
                loss.backward()
            running += loss.detach()
            if not sync:
                continue
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d/%d loss %.4f lr %.3e", epoch, step, total,
                            running.item() / 10, sched.get_last_lr()[0])
            if step % 10 == 0:
                running.zero_()
            if step % args.eval_every == 0:
                vl = evaluate(model, va_loader, device)
                logger.info("step %d eval_loss %.4f ppl %.2f", step, vl, math.exp(vl))
        save_full(model, tokenizer, os.path.join(args.out, f"epoch_{epoch}"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
