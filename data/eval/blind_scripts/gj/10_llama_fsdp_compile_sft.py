"""Full fine-tune of Llama-3-8B with FSDP + torch.compile on packed chat data.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        llama_fsdp_compile_sft.py --model meta-llama/Meta-Llama-3-8B --data /shared/sft/packed_4k \
        --output /shared/ckpt/llama3-8b-sft
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="load_from_disk dataset with input_ids/labels, already packed")
    ap.add_argument("--output", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=500)
    return ap.parse_args()


def collate(rows):
    ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    labels = torch.tensor([r["labels"] for r in rows], dtype=torch.long)
    return ids, labels


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for ids, labels in loader:
        ids, labels = ids.to(device), labels.to(device)
        out = model(input_ids=ids, labels=labels)
        ntok = (labels[:, 1:] != -100).sum()
        acc[0] += out.loss.double() * ntok
        acc[1] += ntok
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def save_model(model, tokenizer, config, out_dir, rank):
    if rank == 0:
        save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
            state = model.state_dict()
        state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
        os.makedirs(out_dir, exist_ok=True)
        torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
        config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        print(f"saved {out_dir}", flush=True)
    dist.barrier()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = AutoConfig.from_pretrained(args.model)
    ds = load_from_disk(args.data)
    train_ds, eval_ds = ds["train"], ds["test"]

    # only rank 0 reads the weights; the other ranks build an empty model on the meta device
    # and receive the weights through sync_module_states when FSDP wraps the model
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=device,
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=device, recurse=False)) if rank != 0 else None,
        use_orig_params=True,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )
    model = torch.compile(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    eval_sampler = DistributedSampler(eval_ds, num_replicas=world, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.micro_batch, sampler=eval_sampler, collate_fn=collate, num_workers=2)

    total_steps = args.epochs * len(train_dl) // args.grad_accum

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    step, micro = 0, 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for ids, labels in train_dl:
            ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            out = model(input_ids=ids, labels=labels)
            (out.loss / args.grad_accum).backward()
            micro += 1
            if micro % args.grad_accum != 0:
                continue
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                loss = out.loss.detach().float()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tok_s = 10 * args.grad_accum * args.micro_batch * ids.size(1) * world / (time.time() - t0)
                    print(f"ep {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {tok_s:,.0f} tok/s", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                val = evaluate(model, eval_dl, device)
                if rank == 0:
                    print(f"step {step} eval loss {val:.4f}", flush=True)
                save_model(model, tokenizer, config, os.path.join(args.output, f"step_{step}"), rank)

    save_model(model, tokenizer, config, os.path.join(args.output, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
