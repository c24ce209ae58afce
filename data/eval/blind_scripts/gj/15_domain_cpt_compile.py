"""Continued pretraining of a ~1B causal LM on a domain corpus (jsonl), DDP + torch.compile.

The corpus is tokenized once into a flat uint32 .bin next to the jsonl and
memory-mapped afterwards; training samples are fixed 4096-token windows so the
compiled graph has a single static shape.

    torchrun --nnodes=1 --nproc_per_node=8 domain_cpt_compile.py \
        --corpus /shared/corpora/legal_2024.jsonl --model meta-llama/Llama-3.2-1B --out /shared/ckpt/legal_cpt
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--val-fraction", type=float, default=0.005)
    ap.add_argument("--save-every", type=int, default=2000)
    return ap.parse_args()


def tokenize_corpus(corpus_path, tokenizer, out_path, chunk=2000):
    """Tokenize every document, separate with EOS, and write one flat uint32 array."""
    buf, n_tokens = [], 0
    with open(corpus_path) as fin, open(out_path, "wb") as fout:
        for line in fin:
            text = json.loads(line)["text"]
            buf.append(text)
            if len(buf) == chunk:
                ids = tokenizer(buf, add_special_tokens=False)["input_ids"]
                arr = np.fromiter((t for doc in ids for t in doc + [tokenizer.eos_token_id]), dtype=np.uint32)
                fout.write(arr.tobytes())
                n_tokens += arr.size
                buf = []
        if buf:
            ids = tokenizer(buf, add_special_tokens=False)["input_ids"]
            arr = np.fromiter((t for doc in ids for t in doc + [tokenizer.eos_token_id]), dtype=np.uint32)
            fout.write(arr.tobytes())
            n_tokens += arr.size
    return n_tokens


class Windows(Dataset):
    def __init__(self, tokens, seq_len, start, stop):
        self.tokens, self.seq_len = tokens, seq_len
        self.offsets = np.arange(start, stop - seq_len - 1, seq_len)

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, i):
        o = self.offsets[i]
        w = torch.from_numpy(self.tokens[o : o + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        tot[0] += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    bin_path = os.path.splitext(args.corpus)[0] + f".{os.path.basename(args.model)}.u32.bin"
    if not os.path.exists(bin_path):
        n = tokenize_corpus(args.corpus, tokenizer, bin_path)
        print(f"[rank {rank}] tokenized {args.corpus}: {n:,} tokens -> {bin_path}", flush=True)
    tokens = np.memmap(bin_path, dtype=np.uint32, mode="r")

    n_val = int(len(tokens) * args.val_fraction)
    split = len(tokens) - n_val
    train_ds = Windows(tokens, args.seq_len, 0, split)
    val_ds = Windows(tokens, args.seq_len, split, len(tokens))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    raw_model = model
    model = torch.compile(DDP(model, device_ids=[local_rank]))

    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    total = args.epochs * len(train_dl)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, total - args.warmup)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))

    if rank == 0:
        print(f"{len(train_ds):,} train windows, {len(val_ds):,} val windows, {total:,} steps", flush=True)

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = 50 * args.batch_size * args.seq_len * world / (time.time() - t0)
                    print(f"step {step}/{total} loss {l.item():.4f} lr {lr_at(step):.2e} {tps:,.0f} tok/s", flush=True)
                t0 = time.time()

            if step % args.save_every == 0 or step == total:
                val_loss = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
                    path = os.path.join(args.out, f"step_{step}")
                    raw_model.save_pretrained(path, safe_serialization=True)
                    tokenizer.save_pretrained(path)
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
