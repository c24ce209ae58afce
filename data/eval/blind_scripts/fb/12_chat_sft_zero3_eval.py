#!/usr/bin/env python
"""Multi-turn chat SFT, ZeRO-3, with a generation-based eval pass after each epoch.

deepspeed --hostfile /shared/hostfile --num_nodes 4 --num_gpus 8 chat_sft_zero3_eval.py \
    --deepspeed --deepspeed_config /shared/configs/zero3_bf16.json \
    --model /shared/models/llama-2-70b --raw_data /shared/data/chat_v5 \
    --cache /shared/cache/chat_v5_tok --output /shared/ckpt/chat70b
"""
import argparse
import json
import os
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset, load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq
from transformers.integrations import HfDeepSpeedConfig


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--raw_data", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--gen_prompts", default="/shared/data/chat_v5/eval_prompts.jsonl")
    p.add_argument("--gen_max_new_tokens", type=int, default=256)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def format_user(text):
    return f"[INST] {text.strip()} [/INST]"


def tokenize_fn(tok, max_len):
    def fn(ex):
        ids, labels = [tok.bos_token_id], [-100]
        for turn in ex["conversation"]:
            if turn["role"] == "user":
                t = tok(format_user(turn["content"]), add_special_tokens=False)["input_ids"]
                labels += [-100] * len(t)
            else:
                t = tok(" " + turn["content"].strip(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                labels += t
            ids += t
        return {"input_ids": ids[:max_len], "attention_mask": [1] * min(len(ids), max_len),
                "labels": labels[:max_len]}
    return fn


def get_dataset(args, tok, rank):
    # tokenize once on global rank 0 (cache lives on shared storage), everyone else waits and loads
    if rank == 0 and not os.path.isdir(args.cache):
        raw = load_dataset("json", data_files=os.path.join(args.raw_data, "train.jsonl"), split="train")
        tokd = raw.map(tokenize_fn(tok, args.max_len), remove_columns=raw.column_names, num_proc=32)
        tmp = args.cache + ".tmp"
        tokd.save_to_disk(tmp)
        os.replace(tmp, args.cache)
    dist.barrier()
    return load_from_disk(args.cache)


@torch.no_grad()
def generation_eval(engine, tok, prompts, args, epoch, rank, world):
    """Every rank generates for its shard; ZeRO-3 needs all ranks inside generate() together."""
    engine.eval()
    idx = list(range(len(prompts)))
    sampler = DistributedSampler(idx, num_replicas=world, rank=rank, shuffle=False)
    results = []
    for i in sampler:
        inp = tok(format_user(prompts[i]), return_tensors="pt")["input_ids"].to(engine.device)
        out = engine.module.generate(inp, max_new_tokens=args.gen_max_new_tokens, do_sample=False,
                                     synced_gpus=True, pad_token_id=tok.pad_token_id)
        results.append((i, tok.decode(out[0, inp.shape[1]:], skip_special_tokens=True)))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    engine.train()
    if rank == 0:
        merged = dict(pair for part in gathered for pair in part)  # drops the sampler's padding duplicates
        path = os.path.join(args.output, f"generations_epoch{epoch}.jsonl")
        with open(path, "w") as f:
            for i in sorted(merged):
                f.write(json.dumps({"prompt": prompts[i], "response": merged[i]}) + "\n")


def main():
    args = get_args()
    # first run tokenizes on rank 0 while the rest sit in a barrier; give that more than the default 30 min
    deepspeed.init_distributed(timeout=timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.deepspeed_config) as f:
        ds_cfg = json.load(f)
    dschf = HfDeepSpeedConfig(ds_cfg)  # noqa: F841  -> from_pretrained partitions weights while loading

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token
    dataset = get_dataset(args, tok, rank)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

    mbs = engine.train_micro_batch_size_per_gpu()
    sampler = DistributedSampler(dataset, shuffle=True, seed=2024)
    loader = DataLoader(dataset, batch_size=mbs, sampler=sampler,
                        collate_fn=DataCollatorForSeq2Seq(tok, padding="longest"), num_workers=4)
    with open(args.gen_prompts) as f:
        prompts = [json.loads(l)["prompt"] for l in f]

    start_epoch = 0
    if os.path.exists(os.path.join(args.output, "latest")):
        _, cs = engine.load_checkpoint(args.output)
        start_epoch = cs["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for batch in loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and engine.global_steps % 10 == 0 and rank == 0:
                print(f"epoch {epoch} step {engine.global_steps} loss {loss.item():.4f}", flush=True)

        engine.save_checkpoint(args.output, tag=f"epoch{epoch}", client_state={"epoch": epoch})
        generation_eval(engine, tok, prompts, args, epoch, rank, world)

    engine.save_16bit_model(os.path.join(args.output, "hf"), "pytorch_model.bin")
    if rank == 0:
        tok.save_pretrained(os.path.join(args.output, "hf"))
        engine.module.config.save_pretrained(os.path.join(args.output, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
