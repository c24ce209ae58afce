#!/usr/bin/env python
"""Vocabulary extension + continued pretraining for a new language (ZeRO-3).

New tokens are initialised from the mean of the embeddings of the pieces the *old* tokenizer
splits them into, which converges much faster than random init.

deepspeed --num_gpus 8 extend_vocab_zero3.py --base /data/models/Mistral-7B-v0.1 \
    --new_tokens data/th_tokens.txt --corpus /data/th_corpus/tokenized --out /data/ckpt/mistral-th
"""
import argparse
import logging
import os

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator
from transformers.integrations import HfDeepSpeedConfig

logger = logging.getLogger("vocab_ext")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--new_tokens", required=True, help="one token per line")
    ap.add_argument("--corpus", required=True, help="dataset of fixed-length input_ids blocks (save_to_disk)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--embed_lr_mult", type=float, default=5.0)
    ap.add_argument("--max_steps", type=int, default=20000)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def ds_config_for(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr, "warmup_num_steps": 500,
                                 "total_num_steps": args.max_steps}},
    }


def init_new_embeddings(model, old_tok, new_tokens, new_ids):
    in_w = model.get_input_embeddings().weight
    out_w = model.get_output_embeddings().weight
    with torch.no_grad():
        for tok_str, new_id in zip(new_tokens, new_ids):
            pieces = old_tok(tok_str, add_special_tokens=False)["input_ids"]
            if not pieces:
                continue
            in_w.data[new_id] = in_w.data[pieces].mean(dim=0)
            out_w.data[new_id] = out_w.data[pieces].mean(dim=0)


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    ds_config = ds_config_for(args, world)
    hf_ds = HfDeepSpeedConfig(ds_config)  # noqa: F841

    old_tok = AutoTokenizer.from_pretrained(args.base)
    tok = AutoTokenizer.from_pretrained(args.base)
    with open(args.new_tokens, encoding="utf-8") as f:
        candidates = [l.rstrip("\n") for l in f if l.strip()]
    vocab = tok.get_vocab()
    new_tokens = [t for t in candidates if t not in vocab]
    tok.add_tokens(new_tokens)
    new_ids = tok.convert_tokens_to_ids(new_tokens)
    logger.info("adding %d tokens (%d -> %d)", len(new_tokens), len(old_tok), len(tok))

    model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16)
    model.resize_token_embeddings(len(tok))
    init_new_embeddings(model, old_tok, new_tokens, new_ids)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    embed_params = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    embed_ids = {id(p) for p in embed_params}
    other_params = [p for p in model.parameters() if id(p) not in embed_ids]
    param_groups = [
        {"params": other_params},
        {"params": embed_params, "lr": args.lr * args.embed_lr_mult},
    ]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=ds_config)

    data = load_from_disk(args.corpus).with_format("torch")
    sampler = DistributedSampler(data, shuffle=True, seed=99)
    loader = DataLoader(data, batch_size=args.micro_bs, sampler=sampler, collate_fn=default_data_collator,
                        num_workers=4, drop_last=True)

    if os.path.exists(os.path.join(args.out, "latest")):
        engine.load_checkpoint(args.out)

    epoch = engine.global_samples // len(data)
    engine.train()
    while engine.global_steps < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            ids = batch["input_ids"].to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue
            step = engine.global_steps
            if step % 20 == 0:
                logger.info("step %d loss %.4f lr %s", step, loss.item(), engine.get_lr())
            if step % args.save_every == 0:
                engine.save_checkpoint(args.out, tag=f"step{step}")
            if step >= args.max_steps:
                break
        epoch += 1

    engine.save_checkpoint(args.out, tag=f"step{engine.global_steps}")
    engine.save_16bit_model(os.path.join(args.out, "hf"))
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "hf"))
        engine.module.config.save_pretrained(os.path.join(args.out, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
