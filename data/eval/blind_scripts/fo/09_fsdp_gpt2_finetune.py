"""Domain-adaptive fine-tuning of GPT-2 XL with FSDP.

fp16 mixed precision through FSDP's MixedPrecision + ShardedGradScaler, non-reentrant
activation checkpointing, gradient accumulation with no_sync, sharded gradient clipping,
full-state-dict checkpoints (model + optimizer) gathered to rank 0.

torchrun --nproc_per_node=8 09_fsdp_gpt2_finetune.py --train data/pubmed_train.txt --valid data/pubmed_valid.txt
"""
import argparse
import contextlib
import datetime
import functools
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--cache_dir", default="cache/tokens")
    ap.add_argument("--out", default="ckpt/gpt2xl_pubmed")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=1.0)
    return ap.parse_args()


def tokenize_to_blocks(path, tokenizer, ctx, cache_file, rank):
    """Rank 0 tokenizes and writes the cache; everybody else waits and then reads it."""
    if rank == 0 and not os.path.exists(cache_file):
        with open(path, encoding="utf-8") as f:
            ids = tokenizer(f.read())["input_ids"]
        n = (len(ids) - 1) // ctx
        blocks = torch.tensor(ids[: n * ctx + 1])
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        torch.save(blocks, cache_file + ".tmp")
        os.replace(cache_file + ".tmp", cache_file)
    dist.barrier()
    flat = torch.load(cache_file)
    n = (flat.numel() - 1) // ctx
    x = flat[: n * ctx].view(n, ctx)
    y = flat[1 : n * ctx + 1].view(n, ctx)
    return TensorDataset(x, y)


def full_checkpoint(model, optimizer, scaler, epoch, path, rank):
    # every rank takes part in the gather; only rank 0 receives and writes the result
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": model_state, "optim": optim_state,
                    "scaler": scaler.state_dict(), "epoch": epoch}, path)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        s[0] += torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: rank 0 may spend a while tokenizing on the first run
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = tokenize_to_blocks(args.train, tokenizer, args.ctx,
                                  os.path.join(args.cache_dir, "train.pt"), rank)
    valid_ds = tokenize_to_blocks(args.valid, tokenizer, args.ctx,
                                  os.path.join(args.cache_dir, "valid.pt"), rank)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    # FSDP forwards are collective: keep the per-rank validation batch count equal
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.mbs, sampler=train_sampler, drop_last=True,
                          num_workers=2, pin_memory=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.mbs, sampler=valid_sampler, drop_last=True)

    model = AutoModelForCausalLM.from_pretrained(args.model)
    model.config.use_cache = False
    fp16_policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                 buffer_dtype=torch.float32)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}),
        mixed_precision=fp16_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, GPT2Block),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates = args.epochs * (len(train_dl) // args.accum)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=updates,
                                                pct_start=0.05, anneal_strategy="cos")
    scaler = ShardedGradScaler(init_scale=2.0**14)

    n_updates = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        usable = (len(train_dl) // args.accum) * args.accum
        for it, (x, y) in enumerate(train_dl):
            if it >= usable:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = (it + 1) % args.accum == 0
            with (contextlib.nullcontext() if sync else model.no_sync()):
                logits = model(input_ids=x).logits
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                scaler.scale(loss / args.accum).backward()
            if not sync:
                continue
            scaler.unscale_(optimizer)
            total_norm = model.clip_grad_norm_(args.clip)
            prev_scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            # the inf check inside ShardedGradScaler is all-reduced, so every rank agrees here
            if scaler.get_scale() >= prev_scale:
                sched.step()
            n_updates += 1
            if n_updates % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} upd {n_updates}/{updates} loss {l.item():.4f} "
                          f"norm {total_norm.item():.3f} scale {scaler.get_scale():.0f}", flush=True)

        val = evaluate(model, valid_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: valid loss {val:.4f}  ppl {math.exp(val):.2f}", flush=True)
        full_checkpoint(model, optimizer, scaler, epoch, os.path.join(args.out, f"epoch{epoch}.pt"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
