"""Full-parameter FSDP fine-tune of Qwen2.5-Coder-7B for code completion (8k packed context).

    torchrun --nproc_per_node=8 15_qwen7b_fsdp_completion.py --data /mnt/nfs/code/packed_8k
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
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-Coder-7B")
    p.add_argument("--data", required=True)
    p.add_argument("--output_dir", default="/mnt/nfs/ckpt/qwen7b-completion")
    p.add_argument("--micro_bs", type=int, default=1)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


def collate(rows):
    x = torch.stack([torch.as_tensor(r["input_ids"], dtype=torch.long) for r in rows])
    return x


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for x in loader:
        x = x.to(device)
        stats[0] += model(input_ids=x, labels=x).loss.float()
        stats[1] += 1
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def save_hf_checkpoint(model, tokenizer, out_dir, rank):
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        model.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        print(f"saved {out_dir}", flush=True)
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_from_disk(args.data)
    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(data["validation"], shuffle=False, drop_last=True)
    train_dl = DataLoader(data["train"], batch_size=args.micro_bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    val_dl = DataLoader(data["validation"], batch_size=args.micro_bs, sampler=val_sampler, collate_fn=collate)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Qwen2DecoderLayer),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = len(train_dl) // args.accum * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total)

    if rank == 0:
        print(f"train blocks {len(data['train'])}, updates {total}, world {world}", flush=True)

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, x in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            last = (i + 1) % args.accum == 0
            if last:
                loss = model(input_ids=x, labels=x).loss
                (loss / args.accum).backward()
            else:
                with model.no_sync():
                    loss = model(input_ids=x, labels=x).loss
                    (loss / args.accum).backward()
                continue
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t0) / 10
                    t0 = time.time()
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {dt:.1f}s/step", flush=True)
            if step % args.eval_every == 0:
                vl = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if step % args.save_every == 0:
                save_hf_checkpoint(model, tokenizer, os.path.join(args.output_dir, f"step{step}"), rank)

    save_hf_checkpoint(model, tokenizer, os.path.join(args.output_dir, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
