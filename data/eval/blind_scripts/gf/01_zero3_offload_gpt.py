"""
Continued pre-training of a decoder-only LM with DeepSpeed ZeRO-3 + CPU offload.

Launch:
    deepspeed --num_gpus 4 01_zero3_offload_gpt.py --model_name EleutherAI/pythia-2.8b \
        --train_file data/train.jsonl --output_dir runs/pythia-zero3
"""
import argparse
import json
import logging
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator
from transformers.integrations import HfDeepSpeedConfig

logger = logging.getLogger("zero3_pretrain")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", type=str, default="EleutherAI/pythia-2.8b")
    p.add_argument("--train_file", type=str, required=True)
    p.add_argument("--val_file", type=str, default=None)
    p.add_argument("--output_dir", type=str, default="runs/zero3")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup_steps", type=int, default=200)
    p.add_argument("--max_steps", type=int, default=5000)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def build_ds_config(args, world_size):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": args.lr,
                "warmup_num_steps": args.warmup_steps,
                "total_num_steps": args.max_steps,
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
        },
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
        "steps_per_print": 50,
        "wall_clock_breakdown": False,
    }


def load_and_tokenize(path, tokenizer, seq_len):
    raw = load_dataset("json", data_files=path, split="train")

    def tok(batch):
        return tokenizer(batch["text"], add_special_tokens=False)

    def group(batch):
        ids = sum(batch["input_ids"], [])
        total = (len(ids) // seq_len) * seq_len
        chunks = [ids[i : i + seq_len] for i in range(0, total, seq_len)]
        return {"input_ids": chunks, "labels": [c[:] for c in chunks]}

    ds = raw.map(tok, batched=True, remove_columns=raw.column_names, num_proc=8)
    ds = ds.map(group, batched=True, remove_columns=ds.column_names, num_proc=8)
    ds.set_format("torch")
    return ds


@torch.no_grad()
def evaluate(engine, loader, max_batches=100):
    engine.eval()
    loss_sum = torch.zeros(1, device=engine.device)
    count = torch.zeros(1, device=engine.device)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        out = engine(**batch)
        loss_sum += out.loss.float()
        count += 1
    dist.all_reduce(loss_sum)
    dist.all_reduce(count)
    engine.train()
    mean = (loss_sum / count.clamp(min=1)).item()
    return mean, math.exp(min(mean, 20))


def export_hf(engine, tokenizer, out_dir, rank):
    """Write a plain HF folder that can be loaded with from_pretrained()."""
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model = engine.module
        model.config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
        logger.info("exported %d tensors to %s", len(state), out_dir)
    dist.barrier()


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    torch.manual_seed(args.seed)

    ds_config = build_ds_config(args, world_size)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    config = AutoConfig.from_pretrained(args.model_name)
    config.use_cache = False
    # keep this object alive: it makes from_pretrained build the model directly into ZeRO-3 partitions
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841
    model = AutoModelForCausalLM.from_pretrained(args.model_name, config=config, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "ds_config.json"), "w") as f:
            json.dump(ds_config, f, indent=2)
    dist.barrier()

    train_ds = load_and_tokenize(args.train_file, tokenizer, args.seq_len)
    val_ds = load_and_tokenize(args.val_file, tokenizer, args.seq_len) if args.val_file else None

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(
        train_ds,
        batch_size=args.micro_batch,
        sampler=train_sampler,
        collate_fn=default_data_collator,
        num_workers=2,
        pin_memory=True,
        drop_last=True,
    )
    val_loader = None
    if val_ds is not None:
        val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
        val_loader = DataLoader(val_ds, batch_size=args.micro_batch, sampler=val_sampler,
                                collate_fn=default_data_collator, drop_last=True)

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
    )

    ckpt_dir = os.path.join(args.output_dir, "ds_ckpt")
    if os.path.isdir(ckpt_dir):
        load_path, client_state = engine.load_checkpoint(ckpt_dir)
        if load_path is not None:
            logger.info("resumed from %s (global step %d)", load_path, engine.global_steps)

    engine.train()
    epoch = 0
    micro_step = 0
    t0 = time.time()
    while engine.global_steps < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            micro_step += 1

            if micro_step % args.grad_accum != 0:
                continue
            step = engine.global_steps
            if step % 10 == 0 and rank == 0:
                tps = 10 * args.grad_accum * args.micro_batch * args.seq_len * world_size / (time.time() - t0)
                logger.info("step %d loss %.4f lr %.3e tok/s %.0f", step, out.loss.item(),
                            engine.get_lr()[0], tps)
                t0 = time.time()
            if val_loader is not None and step % args.eval_every == 0:
                vl, ppl = evaluate(engine, val_loader)
                logger.info("step %d val_loss %.4f ppl %.2f", step, vl, ppl)
            if step % args.save_every == 0:
                engine.save_checkpoint(ckpt_dir, tag=f"step{step}", client_state={"epoch": epoch})
            if step >= args.max_steps:
                break
        epoch += 1

    engine.save_checkpoint(ckpt_dir, tag="final", client_state={"epoch": epoch})
    export_hf(engine, tokenizer, os.path.join(args.output_dir, "hf_final"), rank)
    logger.info("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
