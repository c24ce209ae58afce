"""Summarisation fine-tuning of flan-t5-xl with FSDP (full shard + CPU offload).

Run with:
    torchrun --nnodes 1 --nproc_per_node 8 05_fsdp_ckpt_t5.py --epochs 3 --save_dir /shared/ckpt/t5xl
"""
import argparse
import functools
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="google/flan-t5-xl")
    p.add_argument("--dataset", default="cnn_dailymail")
    p.add_argument("--dataset_config", default="3.0.0")
    p.add_argument("--src_len", type=int, default=1024)
    p.add_argument("--tgt_len", type=int, default=128)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--save_dir", default="ckpt/t5xl")
    p.add_argument("--offload", action="store_true", default=True)
    p.add_argument("--eval_samples", type=int, default=2000)
    return p.parse_args()


def setup():
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def get_data(args, tok):
    ds = load_dataset(args.dataset, args.dataset_config)

    def prep(batch):
        inputs = ["summarize: " + a for a in batch["article"]]
        enc = tok(inputs, max_length=args.src_len, truncation=True)
        enc["labels"] = tok(text_target=batch["highlights"], max_length=args.tgt_len, truncation=True)["input_ids"]
        return enc

    cols = ds["train"].column_names
    train = ds["train"].map(prep, batched=True, remove_columns=cols, num_proc=16)
    val = ds["validation"].select(range(args.eval_samples)).map(prep, batched=True, remove_columns=cols)
    return train, val


def bf16_ready():
    return torch.cuda.is_bf16_supported() and torch.version.cuda and dist.is_nccl_available()


def train_epoch(model, loader, optimizer, sched, epoch, rank, local_rank, sampler):
    model.train()
    sampler.set_epoch(epoch)
    acc = torch.zeros(2, device=local_rank)
    t0 = time.time()
    for step, batch in enumerate(loader):
        batch = {k: v.to(local_rank) for k, v in batch.items()}
        out = model(**batch)
        out.loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sched.step()
        acc[0] += out.loss.detach().float()
        acc[1] += 1
        if rank == 0 and step % 50 == 0:
            print(f"[ep {epoch}] step {step}/{len(loader)} loss {out.loss.item():.4f} "
                  f"{(time.time() - t0) / (step + 1):.2f}s/step", flush=True)
    dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    return (acc[0] / acc[1]).item()


@torch.no_grad()
def validate(model, loader, local_rank):
    model.eval()
    acc = torch.zeros(2, device=local_rank)
    for batch in loader:
        batch = {k: v.to(local_rank) for k, v in batch.items()}
        out = model(**batch)
        acc[0] += out.loss.float()
        acc[1] += 1
    dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    return (acc[0] / acc[1]).item()


def save_model(model, tok, path, rank):
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
            cpu_state = model.state_dict()
        torch.save(cpu_state, os.path.join(path, "model.pt"))
        tok.save_pretrained(path)
        print(f"checkpoint written to {path}", flush=True)
    dist.barrier()


def main():
    args = parse()
    rank, world_size, local_rank = setup()
    torch.manual_seed(1)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = T5ForConditionalGeneration.from_pretrained(args.model)

    train, val = get_data(args, tok)
    collate = DataCollatorForSeq2Seq(tok, model=model, padding="longest", pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train, rank=rank, num_replicas=world_size, shuffle=True)
    val_sampler = DistributedSampler(val, rank=rank, num_replicas=world_size, shuffle=False)
    train_loader = DataLoader(train, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val, batch_size=args.bs, sampler=val_sampler, collate_fn=collate, num_workers=2)

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})
    mp = None
    if bf16_ready():
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        if rank == 0:
            print("using bf16 mixed precision")

    model = FSDP(
        model,
        auto_wrap_policy=policy,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        cpu_offload=CPUOffload(offload_params=args.offload),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000, gamma=0.85)

    best = float("inf")
    for epoch in range(args.epochs):
        t0 = time.time()
        tr = train_epoch(model, train_loader, optimizer, sched, epoch, rank, local_rank, train_sampler)
        vl = validate(model, val_loader, local_rank)
        if rank == 0:
            print(f"epoch {epoch} train {tr:.4f} val {vl:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if vl < best:
            best = vl
            save_model(model, tok, os.path.join(args.save_dir, "best"), rank)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
