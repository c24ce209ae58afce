"""Code LM fine-tuning from many jsonl.gz shards, streamed and packed on the fly
(ConstantLengthDataset-style), so the corpus never has to fit in memory.

    torchrun --nproc_per_node=8 18_streaming_shards_packing.py --shard_glob "/data/the-stack-py/train-*.jsonl.gz"
"""
import argparse
import glob
import gzip
import json
import math
import os
import random

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bigcode/starcoderbase-3b")
    p.add_argument("--shard_glob", required=True)
    p.add_argument("--val_file", default="/data/the-stack-py/valid.jsonl.gz")
    p.add_argument("--out_dir", default="ckpt/sc3b-stack-py")
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--micro_bs", type=int, default=1)
    p.add_argument("--accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--est_steps_per_epoch", type=int, default=2500)
    p.add_argument("--val_blocks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_shard(path):
    with gzip.open(path, "rt") as f:
        for line in f:
            yield json.loads(line)["content"]


class PackedStream(IterableDataset):
    """Each rank (and each dataloader worker) reads a disjoint subset of the shards and
    packs the token stream into seq_len blocks."""

    def __init__(self, files, tokenizer, seq_len, rank, world, seed):
        self.files = sorted(files)
        self.tok = tokenizer
        self.seq_len = seq_len
        self.rank, self.world = rank, world
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        files = self.files[:]
        random.Random(self.seed + self.epoch).shuffle(files)
        files = files[self.rank :: self.world]
        info = get_worker_info()
        if info is not None:
            files = files[info.id :: info.num_workers]
        buf = []
        for path in files:
            for text in read_shard(path):
                buf.extend(self.tok(text, add_special_tokens=False)["input_ids"])
                buf.append(self.tok.eos_token_id)
                while len(buf) >= self.seq_len:
                    yield torch.tensor(buf[: self.seq_len], dtype=torch.long)
                    buf = buf[self.seq_len :]


def load_val_blocks(path, tokenizer, seq_len, n_blocks):
    buf, blocks = [], []
    for text in read_shard(path):
        buf.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        while len(buf) >= seq_len and len(blocks) < n_blocks:
            blocks.append(torch.tensor(buf[:seq_len], dtype=torch.long))
            buf = buf[seq_len:]
        if len(blocks) >= n_blocks:
            break
    return blocks


@torch.no_grad()
def evaluate(net, blocks, rank, world, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x in blocks[rank::world]:
        x = x.unsqueeze(0).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s[0] += net(input_ids=x, labels=x).loss.float()
        s[1] += 1
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    files = glob.glob(args.shard_glob)
    stream = PackedStream(files, tok, args.seq_len, rank, world, args.seed)
    loader = DataLoader(stream, batch_size=args.micro_bs, num_workers=4, pin_memory=True, prefetch_factor=4)
    val_blocks = load_val_blocks(args.val_file, tok, args.seq_len, args.val_blocks)
    if rank == 0:
        print(f"{len(files)} shards, {len(val_blocks)} val blocks, world {world}", flush=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = args.est_steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, 100, total_steps)

    step = 0
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)
        model.train()
        micro = 0
        for x in loader:
            x = x.to(device, non_blocking=True)
            micro += 1
            boundary = micro % args.accum == 0
            model.require_backward_grad_sync = boundary
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            (loss / args.accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        optimizer.zero_grad(set_to_none=True)

        vl = evaluate(model.module, val_blocks, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} done after {step} steps; val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            path = os.path.join(args.out_dir, f"epoch{epoch}")
            model.module.save_pretrained(path)
            tok.save_pretrained(path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
