"""
FSDP fine-tuning of GPT-NeoX-style models (pythia-6.9b) on code data.

Memory plan for 8 x A100-40GB: FULL_SHARD + bf16 params, activation checkpointing on every
GPTNeoXLayer, optional parameter offload to CPU (--cpu_offload) for the 12B variant.

    torchrun --nproc_per_node 8 10_fsdp_full_save.py --model EleutherAI/pythia-6.9b \
        --train data/code_train.jsonl --val data/code_val.jsonl --out /shared/runs/pythia-code
"""
import argparse
import functools
import json
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
from torch.distributed.fsdp import (
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="EleutherAI/pythia-6.9b")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="runs/pythia-code")
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--cpu_offload", action="store_true")
    return ap.parse_args()


def packed_dataset(path, tok, block):
    ds = load_dataset("json", data_files=path, split="train")
    ds = ds.map(lambda b: tok(b["content"]), batched=True, remove_columns=ds.column_names, num_proc=8)

    def pack(b):
        ids = [t for seq in b["input_ids"] for t in seq + [tok.eos_token_id]]
        n = len(ids) // block * block
        chunks = [ids[i : i + block] for i in range(0, n, block)]
        return {"input_ids": chunks, "attention_mask": [[1] * block for _ in chunks], "labels": chunks}

    return ds.map(pack, batched=True, remove_columns=ds.column_names, num_proc=8)


def save_checkpoint(model, optimizer, scheduler, epoch, step, path):
    model_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, model_cfg, optim_cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(
        {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "step": step,
        },
        path,
    )
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        t[0] += model(**batch).loss.float()
        t[1] += 1
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.config.use_cache = False

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPTNeoXLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        cpu_offload=CPUOffload(offload_params=True) if args.cpu_offload else None,
        device_id=device,
        use_orig_params=True,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, GPTNeoXLayer),
    )

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_ds = packed_dataset(args.train, tok, args.block)
    val_ds = packed_dataset(args.val, tok, args.block)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                              collate_fn=default_data_collator, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False),
                            collate_fn=default_data_collator)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))),
    )

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0 and rank == 0:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

        val = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"== epoch {epoch} val_loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)
        save_checkpoint(model, optimizer, scheduler, epoch, step, os.path.join(args.out, f"epoch_{epoch}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
