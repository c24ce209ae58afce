"""
Streaming causal-LM pretraining on gzipped JSONL shards.

Each shard is a .jsonl.gz with one {"text": ...} document per line. Documents are
tokenized on the fly inside the DataLoader workers and packed into fixed-length
sequences. Training runs for a fixed number of optimizer steps, not epochs.

    torchrun --nproc_per_node=8 01_jsonl_gpt_pretrain.py \
        --data_dir /data/c4_en/train --val_dir /data/c4_en/val --out_dir /ckpt/gpt_small
"""
import argparse
import glob
import gzip
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--val_dir", required=True)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--global_batch_size", type=int, default=512)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=100_000)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_batches", type=int, default=50)
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class PackedJsonlStream(IterableDataset):
    """Streams documents from a list of shards and packs them into seq_len+1 windows."""

    def __init__(self, shards, tokenizer, seq_len, seed, loop=True):
        self.shards = list(shards)
        self.tok = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.loop = loop

    @staticmethod
    def _read(path):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    yield json.loads(line)["text"]

    def __iter__(self):
        info = get_worker_info()
        wid, nworkers = (info.id, info.num_workers) if info is not None else (0, 1)
        shards = self.shards[wid::nworkers]
        rng = random.Random(self.seed * 100 + wid)
        eos = self.tok.eos_token_id
        buf = []
        while True:
            order = list(shards)
            rng.shuffle(order)
            for path in order:
                for text in self._read(path):
                    buf.extend(self.tok(text)["input_ids"])
                    buf.append(eos)
                    while len(buf) >= self.seq_len + 1:
                        chunk, buf = buf[: self.seq_len + 1], buf[self.seq_len + 1:]
                        yield torch.tensor(chunk, dtype=torch.long)
            if not self.loop:
                return


def lr_at(step, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.min_lr + coeff * (args.lr - args.min_lr)


@torch.no_grad()
def evaluate(model, loader, n_batches, device):
    model.eval()
    loss_sum = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for i, batch in enumerate(loader):
        if i >= n_batches:
            break
        batch = batch.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        loss_sum += out.loss.float()
        count += 1
    dist.all_reduce(loss_sum)
    dist.all_reduce(count)
    model.train()
    return (loss_sum / count.clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    # different seed per replica so dropout masks are not identical across GPUs
    set_seed(args.seed + rank)

    train_shards = sorted(glob.glob(os.path.join(args.data_dir, "*.jsonl.gz")))
    random.shuffle(train_shards)
    rank_shards = train_shards[rank::world_size]
    assert len(rank_shards) >= args.num_workers, (
        f"rank {rank} got {len(rank_shards)} shards for {args.num_workers} workers")
    val_shards = sorted(glob.glob(os.path.join(args.val_dir, "*.jsonl.gz")))[rank::world_size]

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_ds = PackedJsonlStream(rank_shards, tokenizer, args.seq_len, seed=args.seed)
    val_ds = PackedJsonlStream(val_shards, tokenizer, args.seq_len, seed=0, loop=False)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch_size,
                              num_workers=args.num_workers, pin_memory=True,
                              prefetch_factor=4, persistent_workers=True)

    grad_accum = args.global_batch_size // (args.micro_batch_size * world_size)
    assert grad_accum >= 1 and grad_accum * args.micro_batch_size * world_size == args.global_batch_size

    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len,
                        n_embd=768, n_layer=12, n_head=12)
    model = GPT2LMHeadModel(config).to(device)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True)

    start_step = 0
    ckpt_path = os.path.join(args.out_dir, "latest.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_step = ckpt["step"]
        if is_main:
            print(f"resumed from step {start_step}")

    model = DDP(model, device_ids=[local_rank])

    writer = None
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out_dir, "tb"))
        print(f"world={world_size} grad_accum={grad_accum} shards={len(train_shards)}")

    train_iter = iter(train_loader)
    model.train()
    t0 = time.time()
    for step in range(start_step, args.max_steps):
        lr = lr_at(step, args)
        for g in optimizer.param_groups:
            g["lr"] = lr

        loss_accum = torch.zeros(1, device=device)
        for micro in range(grad_accum):
            batch = next(train_iter).to(device, non_blocking=True)
            sync = micro == grad_accum - 1
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
                    loss = out.loss / grad_accum
                loss.backward()
            loss_accum += loss.detach()

        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0:
            dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
            if is_main:
                dt = time.time() - t0
                t0 = time.time()
                tok_s = args.global_batch_size * args.seq_len * args.log_every / dt
                print(f"step {step} loss {loss_accum.item():.4f} lr {lr:.2e} tok/s {tok_s:.0f}")
                writer.add_scalar("train/loss", loss_accum.item(), step)
                writer.add_scalar("train/lr", lr, step)

        if (step + 1) % args.eval_every == 0:
            val_loader = DataLoader(val_ds, batch_size=args.micro_batch_size, num_workers=1)
            val_loss = evaluate(model.module, val_loader, args.eval_batches, device)
            if is_main:
                print(f"step {step + 1} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
                writer.add_scalar("val/loss", val_loss, step + 1)

        if (step + 1) % args.save_every == 0:
            if is_main:
                tmp = ckpt_path + ".tmp"
                torch.save({"model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "step": step + 1,
                            "args": vars(args)}, tmp)
                os.replace(tmp, ckpt_path)
            dist.barrier()

    if is_main:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
