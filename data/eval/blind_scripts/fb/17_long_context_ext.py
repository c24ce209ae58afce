"""Context-length extension (4k -> 16k) by RoPE base rescaling + short continued pretraining.
DeepSpeed ZeRO-3 with parameter and optimizer offload; TensorBoard logging.

deepspeed --num_gpus 8 long_context_ext.py --deepspeed --deepspeed_config cfg/zero3_offload.json \
    --model /models/llama-2-7b --train_dir /data/long_docs/train_16k --val_dir /data/long_docs/val_16k
"""
import argparse
import json
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator
from transformers.integrations import HfDeepSpeedConfig


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--train_dir", required=True)
    p.add_argument("--val_dir", required=True)
    p.add_argument("--output_dir", default="/ckpt/llama2-7b-16k")
    p.add_argument("--target_len", type=int, default=16384)
    p.add_argument("--rope_theta", type=float, default=500000.0)
    p.add_argument("--max_steps", type=int, default=1000)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--save_every", type=int, default=250)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


@torch.no_grad()
def eval_perplexity(engine, loader, max_batches=None):
    engine.eval()
    losses = []
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        ids = batch["input_ids"].to(engine.device)
        losses.append(engine(input_ids=ids, labels=ids).loss.float().item())
    engine.train()
    mean_loss = sum(losses) / max(len(losses), 1)
    return mean_loss, math.exp(mean_loss)


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()

    with open(args.deepspeed_config) as f:
        ds_cfg = json.load(f)
    _hf_ds = HfDeepSpeedConfig(ds_cfg)

    config = AutoConfig.from_pretrained(args.model)
    config.rope_theta = args.rope_theta
    config.max_position_embeddings = args.target_len
    config.use_cache = False
    model = AutoModelForCausalLM.from_pretrained(args.model, config=config, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

    train = load_from_disk(args.train_dir).with_format("torch", columns=["input_ids"])
    val = load_from_disk(args.val_dir).with_format("torch", columns=["input_ids"])
    mbs = engine.train_micro_batch_size_per_gpu()
    tr_sampler = DistributedSampler(train, shuffle=True, seed=1)
    tr_loader = DataLoader(train, batch_size=mbs, sampler=tr_sampler, collate_fn=default_data_collator,
                           num_workers=2, pin_memory=True)
    va_loader = DataLoader(val, batch_size=mbs, sampler=DistributedSampler(val, shuffle=False),
                           collate_fn=default_data_collator, num_workers=1)

    writer = SummaryWriter(os.path.join(args.output_dir, "tb")) if rank == 0 else None

    if os.path.exists(os.path.join(args.output_dir, "latest")):
        engine.load_checkpoint(args.output_dir)

    base_loss, base_ppl = eval_perplexity(engine, va_loader, max_batches=20)
    if rank == 0:
        print(f"initial 16k val loss {base_loss:.4f} ppl {base_ppl:.2f}", flush=True)
        writer.add_scalar("val/ppl", base_ppl, engine.global_steps)

    t0 = time.time()
    data_iter = infinite(tr_loader, tr_sampler)
    while engine.global_steps < args.max_steps:
        batch = next(data_iter)
        ids = batch["input_ids"].to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if not engine.is_gradient_accumulation_boundary():
            continue

        step = engine.global_steps
        if rank == 0 and step % 5 == 0:
            tok_s = engine.train_batch_size() * args.target_len * 5 / (time.time() - t0)
            t0 = time.time()
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("train/lr", engine.get_lr()[0], step)
            writer.add_scalar("train/tokens_per_s", tok_s, step)
            print(f"step {step} loss {loss.item():.4f} tok/s {tok_s:.0f}", flush=True)

        if step % args.eval_every == 0:
            vl, ppl = eval_perplexity(engine, va_loader)
            if rank == 0:
                writer.add_scalar("val/loss", vl, step)
                writer.add_scalar("val/ppl", ppl, step)
                print(f"[eval] step {step} val loss {vl:.4f} ppl {ppl:.2f}", flush=True)

        if step % args.save_every == 0:
            engine.save_checkpoint(args.output_dir, tag=f"step{step}")

    engine.save_checkpoint(args.output_dir, tag="final")
    engine.save_16bit_model(os.path.join(args.output_dir, "hf"))
    if rank == 0:
        config.save_pretrained(os.path.join(args.output_dir, "hf"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
