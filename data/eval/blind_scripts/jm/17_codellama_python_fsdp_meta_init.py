"""FSDP full fine-tune of CodeLlama-7b-Python on long (16k) packed Python files.

Only rank 0 materialises the pretrained weights on CPU; the other ranks build the model
on the meta device and receive the weights from rank 0 when FSDP wraps it
(sync_module_states), so host RAM holds one copy instead of eight.

    torchrun --nproc_per_node=8 17_codellama_python_fsdp_meta_init.py --raw_data /shared/py_files.jsonl
"""
import argparse
import datetime
import functools
import math
import os
from itertools import chain

import torch
import torch.distributed as dist
from datasets import load_dataset, load_from_disk
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
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="codellama/CodeLlama-7b-Python-hf")
    ap.add_argument("--raw_data", required=True)
    ap.add_argument("--cache_dir", default="/shared/cache/py_packed_16k")
    ap.add_argument("--out", default="/shared/ckpt/codellama7b-py-16k")
    ap.add_argument("--seq_len", type=int, default=16384)
    ap.add_argument("--micro_bs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--save_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=123)
    return ap.parse_args()


def build_dataset(args, tokenizer):
    raw = load_dataset("json", data_files=args.raw_data, split="train")
    raw = raw.train_test_split(test_size=0.005, seed=args.seed)

    def tok(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch["content"]], add_special_tokens=True)

    def pack(batch):
        ids = list(chain(*batch["input_ids"]))
        n = len(ids) // args.seq_len * args.seq_len
        blocks = [ids[i : i + args.seq_len] for i in range(0, n, args.seq_len)]
        return {"input_ids": blocks, "labels": [b[:] for b in blocks]}

    tokenized = raw.map(tok, batched=True, num_proc=32, remove_columns=raw["train"].column_names)
    packed = tokenized.map(pack, batched=True, batch_size=2000, num_proc=32, remove_columns=["attention_mask"])
    packed.save_to_disk(args.cache_dir)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        acc[0] += model(**batch).loss.float()
        acc[1] += 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def save(model, optimizer, tokenizer, path, rank):
    """All ranks take part in gathering; only rank 0 gets (and writes) the full tensors."""
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        model.module.save_pretrained(path, state_dict=model_state, safe_serialization=True)
        tokenizer.save_pretrained(path)
        torch.save(optim_state, os.path.join(path, "optim_full.pt"))
    dist.barrier()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # tokenising + packing on rank 0 can take a while on the first run
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if rank == 0 and not os.path.exists(os.path.join(args.cache_dir, "dataset_dict.json")):
        build_dataset(args, tokenizer)
    dist.barrier()
    data = load_from_disk(args.cache_dir).with_format("torch")

    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(data["train"], batch_size=args.micro_bs, sampler=train_sampler,
                          collate_fn=default_data_collator, num_workers=4, pin_memory=True)
    val_dl = DataLoader(data["test"], batch_size=args.micro_bs, collate_fn=default_data_collator,
                        sampler=DistributedSampler(data["test"], shuffle=False, drop_last=True))

    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, use_cache=False)
    else:
        config = AutoConfig.from_pretrained(args.model, use_cache=False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=torch.cuda.current_device(), recurse=False)) if rank != 0 else None,
        use_orig_params=False,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = len(train_dl) // args.accum * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / args.accum
            loss.backward()
            if (i + 1) % args.accum != 0:
                continue
            gnorm = model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach() * args.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} gnorm {gnorm.item():.2f}", flush=True)
            if step % args.save_every == 0:
                save(model, optimizer, tokenizer, os.path.join(args.out, f"step{step}"), rank)

        vl = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

    save(model, optimizer, tokenizer, os.path.join(args.out, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
