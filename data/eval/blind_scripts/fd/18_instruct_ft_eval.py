#!/usr/bin/env python
"""SFT a small causal LM on GSM8K-train, then greedy-decode a test subset and score it.

    torchrun --nproc_per_node=8 18_instruct_ft_eval.py --model Qwen/Qwen2-1.5B \
        --epochs 2 --micro_bs 4 --accum 4 --eval_n 500 --out runs/qwen15_gsm8k
"""
import argparse
import json
import math
import os
import random
import re
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

PROMPT = "Question: {q}\nLet's think step by step.\nAnswer:"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--base_lr", type=float, default=1e-5, help="lr for a global batch of 64")
    ap.add_argument("--max_len", type=int, default=768)
    ap.add_argument("--eval_n", type=int, default=500)
    ap.add_argument("--eval_bs", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def encode(ex, tok, max_len):
    p = tok(PROMPT.format(q=ex["question"]))["input_ids"]
    a = tok(" " + ex["answer"].replace("####", "The answer is") + tok.eos_token,
            add_special_tokens=False)["input_ids"]
    ids = (p + a)[:max_len]
    return {"input_ids": ids, "labels": ([-100] * len(p) + a)[:max_len]}


def collate(batch, pad_id):
    L = max(len(b["input_ids"]) for b in batch)
    out = {k: torch.full((len(batch), L), v) for k, v in
           (("input_ids", pad_id), ("labels", -100), ("attention_mask", 0))}
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        out["input_ids"][i, :n] = torch.tensor(b["input_ids"])
        out["labels"][i, :n] = torch.tensor(b["labels"])
        out["attention_mask"][i, :n] = 1
    return out


def final_number(text):
    m = re.findall(r"The answer is\s*(-?[\d,\.]+)", text)
    return m[-1].replace(",", "").rstrip(".") if m else None


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    train = load_dataset("gsm8k", "main", split="train")
    train = train.map(partial(encode, tok=tok, max_len=args.max_len), remove_columns=train.column_names)
    test = load_dataset("gsm8k", "main", split="test")

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model.to(device), device_ids=[local_rank])

    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.micro_bs, sampler=sampler, num_workers=2,
                        collate_fn=partial(collate, pad_id=tok.pad_token_id), drop_last=True)

    global_bs = args.micro_bs * args.accum * world
    lr = args.base_lr * global_bs / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = len(loader) // args.accum
    total = steps_per_epoch * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, max(1, int(0.03 * total)), total)
    if rank == 0:
        print(f"global batch {global_bs}, lr {lr:.2e}, {total} optimizer steps", flush=True)

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(loader):
            if i >= steps_per_epoch * args.accum:
                break  # drop the incomplete accumulation group at the end of the epoch
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (i + 1) % args.accum == 0
            if sync:
                loss = model(**batch).loss / args.accum
                loss.backward()
            else:
                with model.no_sync():
                    loss = model(**batch).loss / args.accum
                    loss.backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 25 == 0:
                l = loss.detach() * args.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"{time.time() - t0:.0f}s", flush=True)

    ckpt = os.path.join(args.out, "model.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.module.state_dict(), ckpt)
        tok.save_pretrained(args.out)
    dist.barrier()

    # --- eval: every rank reloads the saved weights, same as a fresh eval job would ---
    eval_model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    eval_model.load_state_dict(torch.load(ckpt, map_location="cpu"))
    eval_model.config.use_cache = True
    eval_model.to(device).eval()
    del model, opt
    torch.cuda.empty_cache()

    # rank 0 draws the subset and shares it so every rank agrees on it
    chosen = [None]
    if rank == 0:
        chosen[0] = sorted(random.Random(args.seed).sample(range(len(test)), min(args.eval_n, len(test))))
    dist.broadcast_object_list(chosen, src=0)
    chosen = chosen[0]

    mine = chosen[rank::world]
    tok.padding_side = "left"
    local = []
    with torch.no_grad():
        for s in range(0, len(mine), args.eval_bs):
            idx = mine[s:s + args.eval_bs]
            prompts = [PROMPT.format(q=test[i]["question"]) for i in idx]
            enc = tok(prompts, return_tensors="pt", padding=True).to(device)
            out = eval_model.generate(**enc, max_new_tokens=320, do_sample=False,
                                      pad_token_id=tok.pad_token_id)
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            local.extend((i, t) for i, t in zip(idx, texts))

    parts = [None] * world
    dist.all_gather_object(parts, local)
    if rank == 0:
        preds = dict(p for part in parts for p in part)
        correct = 0
        for i, text in preds.items():
            gold = test[i]["answer"].split("####")[-1].strip().replace(",", "")
            correct += int(final_number(text) == gold)
        acc = correct / len(preds)
        print(f"GSM8K accuracy on {len(preds)} problems: {acc:.4f}")
        with open(os.path.join(args.out, "eval.json"), "w") as f:
            json.dump({"accuracy": acc, "n": len(preds), "steps": step, "lr": lr}, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
