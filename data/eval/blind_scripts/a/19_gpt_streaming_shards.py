"""GPT-2 (124M) pretraining from scratch on jsonl text shards that do not fit in memory.
Each process streams its own subset of the shard files.

    torchrun --nproc_per_node=8 train_gpt_stream.py --train-glob 'corpus/train-*.jsonl' --val-file corpus/val.jsonl
"""
import argparse
import glob
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, get_worker_info
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel


class ShardStream(IterableDataset):
    """Reads jsonl shards line by line, tokenizes and packs into fixed blocks."""

    def __init__(self, files, tokenizer, block_size, seed=0):
        self.files, self.tok, self.block_size, self.seed = files, tokenizer, block_size, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        files = list(self.files)
        random.Random(self.seed + self.epoch).shuffle(files)
        info = get_worker_info()
        if info is not None:  # split this process's files between its DataLoader workers
            files = files[info.id::info.num_workers]
        buf = []
        for path in files:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    buf.extend(self.tok(json.loads(line)["text"])["input_ids"] + [self.tok.eos_token_id])
                    while len(buf) >= self.block_size + 1:
                        chunk, buf = buf[: self.block_size + 1], buf[self.block_size:]
                        yield torch.tensor(chunk, dtype=torch.long)


class ValBlocks(Dataset):
    def __init__(self, path, tokenizer, block_size, max_blocks=2000):
        ids = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                ids.extend(tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id])
                if len(ids) > (block_size + 1) * max_blocks:
                    break
        n = min(max_blocks, (len(ids) - 1) // block_size)
        self.blocks = [torch.tensor(ids[i * block_size:i * block_size + block_size + 1]) for i in range(n)]

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return self.blocks[i]


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    ratio = min(1.0, (it - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for blk in loader:
        blk = blk.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.module(input_ids=blk[:, :-1], labels=blk[:, :-1]).loss
        s += torch.stack([loss.float() * blk.size(0), torch.tensor(float(blk.size(0)), device=device)])
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-glob", required=True)
    ap.add_argument("--val-file", required=True)
    ap.add_argument("--out-dir", default="out/gpt2_stream")
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=12, help="micro batch per GPU")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--warmup-iters", type=int, default=2000)
    ap.add_argument("--lr-decay-iters", type=int, default=60000)
    ap.add_argument("--eval-interval", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    tok = AutoTokenizer.from_pretrained("gpt2")
    all_files = sorted(glob.glob(args.train_glob))
    my_files = all_files[rank::world]
    train_ds = ShardStream(my_files, tok, args.block_size, seed=args.seed + rank)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, num_workers=4, pin_memory=True)
    val_ds = ValBlocks(args.val_file, tok, args.block_size)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.batch_size)

    config = GPT2Config(vocab_size=len(tok), n_positions=args.block_size)
    model = GPT2LMHeadModel(config).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=True)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{len(all_files)} shards, {len(my_files)} on rank 0, world {world}")

    it, t0 = 0, time.time()
    best_val = float("inf")
    for epoch in range(args.epochs):
        train_ds.set_epoch(epoch)
        for blk in train_loader:
            lr = get_lr(it, args)
            for g in optimizer.param_groups:
                g["lr"] = lr
            blk = blk.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=blk[:, :-1], labels=blk[:, :-1]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            it += 1
            if it % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"iter {it} loss {l.item():.4f} lr {lr:.2e} {(time.time() - t0) * 10:.0f}ms/it", flush=True)
                t0 = time.time()
            if it % args.eval_interval == 0:
                val_loss = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"iter {it} val loss {val_loss:.4f}")
                    if val_loss < best_val:
                        best_val = val_loss
                        model.module.save_pretrained(args.out_dir)
                        tok.save_pretrained(args.out_dir)
                dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
