#!/usr/bin/env python
"""Packed SFT for Llama-3.2-3B over a large sharded corpus (hundreds of jsonl.gz files).

Each rank only reads its own subset of the shard files, so host memory stays flat
regardless of corpus size.

    torchrun --nproc_per_node=8 17_sharded_files_packing_ddp.py \
        --train_glob "/data/sft_v3/train-*.jsonl.gz" --eval_file /data/sft_v3/eval.jsonl.gz
"""
import argparse
import glob
import gzip
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.2-3B-Instruct")
    p.add_argument("--train_glob", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--out", default="ckpt/llama32-3b-sftv3")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--eval_interval", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def iter_jsonl(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def encode(msgs, tok):
    ids = tok.apply_chat_template(msgs)
    labels = [-100] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            s = len(tok.apply_chat_template(msgs[:i], add_generation_prompt=True))
            e = len(tok.apply_chat_template(msgs[: i + 1]))
            labels[s:e] = ids[s:e]
    return ids, labels


class PackedBlocks(Dataset):
    """Concatenate conversations and cut into seq_len blocks (labels keep the per-turn mask)."""

    def __init__(self, convs, tok, seq_len):
        buf_ids, buf_lab = [], []
        self.blocks = []
        for msgs in convs:
            ids, lab = encode(msgs, tok)
            buf_ids += ids
            buf_lab += lab
            while len(buf_ids) >= seq_len:
                self.blocks.append((torch.tensor(buf_ids[:seq_len]), torch.tensor(buf_lab[:seq_len])))
                buf_ids, buf_lab = buf_ids[seq_len:], buf_lab[seq_len:]

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        ids, lab = self.blocks[i]
        return {"input_ids": ids, "labels": lab}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for b in loader:
        ids, lab = b["input_ids"].to(device), b["labels"].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=lab).loss
        n = (lab[:, 1:] != -100).sum()
        s += torch.stack([loss.double() * n, n.double()])
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    files = sorted(glob.glob(args.train_glob))
    my_files = files[rank::world]
    t0 = time.time()
    convs = [rec["messages"] for path in my_files for rec in iter_jsonl(path)]
    train_ds = PackedBlocks(convs, tok, args.seq_len)
    del convs
    eval_ds = PackedBlocks([r["messages"] for r in iter_jsonl(args.eval_file)], tok, args.seq_len)
    print(f"[rank {rank}] {len(my_files)} files -> {len(train_ds)} blocks ({time.time() - t0:.0f}s)", flush=True)

    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=2, pin_memory=True,
                          drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.bs, sampler=DistributedSampler(eval_ds, shuffle=False))

    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    total = args.epochs * len(train_dl) // args.accum
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for i, b in enumerate(train_dl):
            ids, lab = b["input_ids"].to(device, non_blocking=True), b["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=lab).loss
            (loss / args.accum).backward()
            if (i + 1) % args.accum:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                r = loss.detach().clone()
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {r.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if step % args.eval_interval == 0:
                el = evaluate(model, eval_dl, device)
                if rank == 0:
                    print(f"[eval] step {step} loss {el:.4f} ppl {math.exp(el):.2f}", flush=True)
                    model.module.save_pretrained(os.path.join(args.out, f"step{step}"))
                dist.barrier()

    el = evaluate(model, eval_dl, device)
    if rank == 0:
        print(f"[final eval] loss {el:.4f}", flush=True)
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
