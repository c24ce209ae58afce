"""
Domain fine-tuning of Mistral-7B with FSDP on 4 x A10G (24GB).

  * FULL_SHARD, parameters + gradients offloaded to CPU (CPUOffload), bf16 compute
  * non-reentrant activation checkpointing of every decoder layer
  * rank 0 alone reads the weights from disk; the other ranks build the model on the meta
    device and receive the weights through sync_module_states
  * micro-batch 1, gradient accumulation under no_sync()

    torchrun --standalone --nproc_per_node 4 20_fsdp_offload_mistral.py --train data/med_train.jsonl \
        --val data/med_val.jsonl --out /fsx/runs/mistral-med
"""
import argparse
import functools
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
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="runs/mistral-med")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=30)
    return ap.parse_args()


def pack(path, tok, seq):
    ds = load_dataset("json", data_files=path, split="train")
    ds = ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=ds.column_names)

    def chunk(b):
        flat = [t for ids in b["input_ids"] for t in ids + [tok.eos_token_id]]
        n = len(flat) // seq * seq
        blocks = [flat[i : i + seq] for i in range(0, n, seq)]
        return {"input_ids": blocks, "labels": blocks}

    return ds.map(chunk, batched=True, remove_columns=ds.column_names)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        s[0] += model(**batch).loss.float()
        s[1] += 1
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = AutoConfig.from_pretrained(args.model)
    cfg.use_cache = False
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.model, config=cfg, torch_dtype=torch.bfloat16)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MistralDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        cpu_offload=CPUOffload(offload_params=True),
        device_id=local_rank,
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=device, recurse=False)) if rank != 0 else None,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, MistralDecoderLayer),
    )

    train_ds = pack(args.train, tok, args.seq)
    val_ds = pack(args.val, tok, args.seq)
    # trim validation to a multiple of the world size: no padded duplicates, same #batches on every rank
    val_ds = val_ds.select(range(len(val_ds) // world * world))
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=1234,
                                       drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=1, sampler=train_sampler, collate_fn=default_data_collator,
                              num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False),
                            collate_fn=default_data_collator)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.epochs * (len(train_loader) // args.accum)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / max(1, total - args.warmup))),
    )

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if (i + 1) % args.accum != 0:
                # with CPU offload, accumulation has to stay inside no_sync()
                with model.no_sync():
                    loss = model(**batch).loss / args.accum
                    loss.backward()
            else:
                loss = model(**batch).loss / args.accum
                loss.backward()
                model.clip_grad_norm_(1.0)
                optimizer.step()
                sched.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step % 10 == 0:
                    dist.all_reduce(run)
                    if rank == 0:
                        print(f"epoch {epoch} step {step}/{total} loss {(run[0] / run[1]).item():.4f} "
                              f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.1f}s/step", flush=True)
                    run.zero_()
                    t0 = time.time()
            run[0] += loss.detach().float() * args.accum
            run[1] += 1

        val_loss = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)

        # every rank takes part in gathering the full state dict; only rank 0 receives and writes it
        save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
            state = model.state_dict()
        if rank == 0:
            out = os.path.join(args.out, f"epoch{epoch}")
            os.makedirs(out, exist_ok=True)
            torch.save(state, os.path.join(out, "pytorch_model.bin"))
            cfg.save_pretrained(out)
            tok.save_pretrained(out)
        del state
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
