#!/usr/bin/env python
"""Grounded-answer SFT for the RAG assistant: prompt = retrieved passages + question, target = cited answer.
ZeRO-2 with bf16; periodic HF-format snapshots go straight to the eval bucket's sync folder.

deepspeed --num_gpus 8 rag_answer_sft.py --deepspeed --deepspeed_config configs/ds_zero2_bf16.json \
    --model /models/Mistral-7B-Instruct-v0.2 --data data/rag_sft/ --out /shared/rag_sft/run7
"""
import argparse
import json
import logging
import math
import os
import random

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger("rag_sft")

TEMPLATE = """[INST] Answer the question using only the passages below. Cite passages as [n].

{passages}

Question: {question} [/INST]"""


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_passages", type=int, default=5)
    ap.add_argument("--shuffle_passages", action="store_true")
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--snapshot_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--local_rank", type=int, default=-1)
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args()


def make_encoder(tok, args):
    def encode(ex, idx):
        passages = ex["passages"][: args.max_passages]
        order = list(range(len(passages)))
        if args.shuffle_passages:
            random.Random(args.seed + idx).shuffle(order)
        text = "\n\n".join(f"[{k + 1}] {passages[j]['title']}: {passages[j]['text']}" for k, j in enumerate(order))
        prompt = TEMPLATE.format(passages=text, question=ex["question"])
        # remap the gold citations to the shuffled numbering
        remap = {j + 1: k + 1 for k, j in enumerate(order)}
        answer = ex["answer"]
        for old, new in sorted(remap.items(), reverse=True):
            answer = answer.replace(f"[{old}]", f"[@{new}]")
        answer = answer.replace("[@", "[")
        p_ids = tok(prompt)["input_ids"]
        a_ids = tok(" " + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = (p_ids + a_ids)[-args.max_len:]
        labels = ([-100] * len(p_ids) + a_ids)[-args.max_len:]
        return {"input_ids": ids, "labels": labels}
    return encode


def collate(pad_id):
    def f(batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), -100, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            lab[i, :n] = torch.tensor(b["labels"])
            att[i, :n] = 1
        return ids, lab, att
    return f


@torch.no_grad()
def dev_loss(engine, loader):
    engine.eval()
    acc = torch.zeros(2, device=engine.device, dtype=torch.float64)
    for ids, lab, att in loader:
        lab = lab.to(engine.device)
        loss = engine(input_ids=ids.to(engine.device), attention_mask=att.to(engine.device), labels=lab).loss
        n = (lab[:, 1:] != -100).sum()
        acc += torch.stack([loss.double() * n, n.double()])
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[1]).item()


def save_hf_snapshot(engine, tok, out_dir, meta):
    os.makedirs(out_dir, exist_ok=True)
    engine.module.save_pretrained(out_dir, safe_serialization=True, max_shard_size="5GB")
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "snapshot_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token

    # rank 0 builds the datasets cache first, the others then read it from the cache
    if rank != 0:
        dist.barrier()
    raw = load_dataset("json", data_files={"train": os.path.join(args.data, "train.jsonl"),
                                           "dev": os.path.join(args.data, "dev.jsonl")})
    enc = make_encoder(tok, args)
    train = raw["train"].map(enc, with_indices=True, remove_columns=raw["train"].column_names)
    dev = raw["dev"].map(enc, with_indices=True, remove_columns=raw["dev"].column_names)
    if rank == 0:
        dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

    mbs = engine.train_micro_batch_size_per_gpu()
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=mbs, sampler=sampler, collate_fn=collate(tok.pad_token_id), num_workers=2)
    dev_loader = DataLoader(dev, batch_size=mbs, sampler=DistributedSampler(dev, shuffle=False),
                            collate_fn=collate(tok.pad_token_id))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, lab, att in loader:
            loss = engine(input_ids=ids.to(engine.device), attention_mask=att.to(engine.device),
                          labels=lab.to(engine.device)).loss
            engine.backward(loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue
            step = engine.global_steps
            if step % 10 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
            if step % args.snapshot_every == 0:
                dl = dev_loss(engine, dev_loader)
                logger.info("step %d dev loss %.4f ppl %.3f", step, dl, math.exp(dl))
                engine.save_checkpoint(os.path.join(args.out, "ds"), tag=f"step{step}")
                save_hf_snapshot(engine, tok, os.path.join(args.out, "hf", f"step{step}"),
                                 {"step": step, "epoch": epoch, "dev_loss": dl})

    dl = dev_loss(engine, dev_loader)
    engine.save_checkpoint(os.path.join(args.out, "ds"), tag="final")
    save_hf_snapshot(engine, tok, os.path.join(args.out, "hf", "final"), {"step": engine.global_steps, "dev_loss": dl})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
