#!/usr/bin/env python
"""
Full-parameter SFT of a small chat model (Qwen2.5-0.5B) on ShareGPT-format JSONL, with sequence packing.
Tokenized + packed data is cached to disk so that later runs start immediately.

    torchrun --nproc_per_node=8 13_qwen_sft_packed.py --data data/sharegpt_clean.jsonl --out runs/qwen05b-sft
"""
import argparse
import hashlib
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE = -100


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    p.add_argument("--data", required=True)
    p.add_argument("--cache_dir", default=".cache/sft_packed")
    p.add_argument("--out", default="runs/qwen05b-sft")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--micro_bs", type=int, default=2)
    p.add_argument("--tokens_per_step", type=int, default=524288, help="global tokens per optimizer step")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--min_lr", type=float, default=2e-6)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--wandb", default="")
    return p.parse_args()


def encode_conversation(tok, conv):
    ids, labels = [], []
    for turn in conv["conversations"]:
        role = "user" if turn["from"] in ("human", "user") else "assistant"
        text = f"<|im_start|>{role}\n{turn['value']}<|im_end|>\n"
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        labels += t if role == "assistant" else [IGNORE] * len(t)
    return ids, labels


def pack(examples, seq_len, pad_id):
    """Greedy packing into fixed-length rows."""
    rows_ids, rows_lbl = [], []
    cur_ids, cur_lbl = [], []
    for ids, lbl in examples:
        ids, lbl = ids[:seq_len], lbl[:seq_len]
        if len(cur_ids) + len(ids) > seq_len:
            pad = seq_len - len(cur_ids)
            rows_ids.append(cur_ids + [pad_id] * pad)
            rows_lbl.append(cur_lbl + [IGNORE] * pad)
            cur_ids, cur_lbl = [], []
        cur_ids += ids
        cur_lbl += lbl
    if cur_ids:
        pad = seq_len - len(cur_ids)
        rows_ids.append(cur_ids + [pad_id] * pad)
        rows_lbl.append(cur_lbl + [IGNORE] * pad)
    return torch.tensor(rows_ids, dtype=torch.int32), torch.tensor(rows_lbl, dtype=torch.int32)


def load_or_build(args, tok):
    key = hashlib.md5(f"{args.data}:{args.model}:{args.seq_len}".encode()).hexdigest()[:12]
    cache_file = os.path.join(args.cache_dir, f"packed_{key}.pt")
    if os.path.exists(cache_file):
        return torch.load(cache_file)
    examples = []
    with open(args.data) as f:
        for line in f:
            examples.append(encode_conversation(tok, json.loads(line)))
    ids, labels = pack(examples, args.seq_len, tok.pad_token_id)
    n_val = max(1, len(ids) // 100)
    data = {"train": (ids[n_val:], labels[n_val:]), "val": (ids[:n_val], labels[:n_val])}
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(data, cache_file)
    return data


class PackedDataset(Dataset):
    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return self.ids.size(0)

    def __getitem__(self, i):
        return self.ids[i].long(), self.labels[i].long()


def lr_at(it, total, args):
    if it < args.warmup:
        return args.lr * (it + 1) / args.warmup
    ratio = (it - args.warmup) / max(1, total - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * ratio))


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for ids, labels in loader:
        ids, labels = ids.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=labels)
        n = (labels[:, 1:] != IGNORE).sum()
        acc += torch.stack([out.loss.float() * n, n.float()])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    master = rank == 0
    torch.manual_seed(1337)

    tok = AutoTokenizer.from_pretrained(args.model)
    data = load_or_build(args, tok)
    train_ds = PackedDataset(*data["train"])
    val_ds = PackedDataset(*data["val"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_bs, sampler=val_sampler, num_workers=2)

    tokens_per_micro = args.micro_bs * args.seq_len * world
    accum = max(1, args.tokens_per_step // tokens_per_micro)
    if master:
        print(f"{len(train_ds)} packed rows, grad accum {accum}, "
              f"{accum * tokens_per_micro} tokens/step", flush=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    model.to(device)
    raw = model
    model = DDP(model, device_ids=[local_rank])
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=True)
    steps_per_epoch = len(train_loader) // accum
    total_steps = steps_per_epoch * args.epochs

    if master and args.wandb:
        import wandb
        wandb.init(project=args.wandb, config=vars(args))

    it = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        loader_iter = iter(train_loader)
        for _ in range(steps_per_epoch):
            t0 = time.time()
            lr = lr_at(it, total_steps, args)
            for g in optimizer.param_groups:
                g["lr"] = lr
            loss_acc = torch.zeros((), device=device)
            for micro in range(accum):
                ids, labels = next(loader_iter)
                ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                sync = micro == accum - 1
                with (nullcontext() if sync else model.no_sync()):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(input_ids=ids, labels=labels).loss / accum
                    loss.backward()
                loss_acc += loss.detach()
            gnorm = torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            it += 1

            if it % 10 == 0:
                dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                if master:
                    tps = accum * tokens_per_micro / (time.time() - t0)
                    print(f"ep {epoch} it {it}/{total_steps} loss {loss_acc.item():.4f} "
                          f"gnorm {gnorm.item():.2f} lr {lr:.2e} {tps / 1e3:.1f}k tok/s", flush=True)
                    if args.wandb:
                        wandb.log({"loss": loss_acc.item(), "lr": lr, "grad_norm": gnorm.item()}, step=it)

        vl = eval_loss(raw, val_loader, device)
        if master:
            print(f"epoch {epoch}: val loss {vl:.4f}", flush=True)
            if args.wandb:
                wandb.log({"val_loss": vl}, step=it)
            save_dir = os.path.join(args.out, f"epoch{epoch}")
            raw.save_pretrained(save_dir, safe_serialization=True)
            tok.save_pretrained(save_dir)
        dist.barrier()

    if master and args.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
