"""
Code LM pretraining on .jsonl.zst shards (The Stack dedup, per-language folders).

Two nodes, eight GPUs each:
    # on every node
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \
        --master_addr=$MASTER_ADDR --master_port=29500 \
        15_zstd_code_lm_multinode.py --data_root /lustre/stack_dedup --out /lustre/runs/code_1b
"""
import argparse
import glob
import io
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import zstandard as zstd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoTokenizer, GPTBigCodeConfig, GPTBigCodeForCausalLM

LANGS = ["python", "java", "javascript", "typescript", "go", "rust", "c", "cpp"]


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default="bigcode/starcoder")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=8)
    ap.add_argument("--global_bs", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=120_000)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


def read_zst_jsonl(path):
    with open(path, "rb") as fh:
        reader = zstd.ZstdDecompressor().stream_reader(fh)
        for line in io.TextIOWrapper(reader, encoding="utf-8"):
            if line.strip():
                yield json.loads(line)


class PackedCodeStream(IterableDataset):
    def __init__(self, shards, tokenizer, seq_len, rank, world_size, seed):
        self.shards = shards
        self.tok = tokenizer
        self.seq_len = seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed

    def __iter__(self):
        info = get_worker_info()
        nw, wid = (info.num_workers, info.id) if info else (1, 0)
        readers = self.world_size * nw
        reader_id = self.rank * nw + wid
        mine = self.shards[reader_id::readers]
        rng = random.Random(self.seed + 31 * reader_id)
        buf, eos = [], self.tok.eos_token_id
        while True:
            rng.shuffle(mine)
            for path in mine:
                for doc in read_zst_jsonl(path):
                    buf.extend(self.tok(doc["content"])["input_ids"] + [eos])
                    while len(buf) >= self.seq_len:
                        yield torch.tensor(buf[:self.seq_len])
                        buf = buf[self.seq_len:]


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world_size = torch.cuda.device_count()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    shards = []
    for lang in LANGS:
        shards += sorted(glob.glob(os.path.join(args.data_root, lang, "*.jsonl.zst")))
    if len(shards) < world_size * args.workers:
        raise RuntimeError(f"{len(shards)} shards < {world_size * args.workers} readers")

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ds = PackedCodeStream(shards, tok, args.seq_len, rank, world_size, args.seed)
    loader = DataLoader(ds, batch_size=args.micro_bs, num_workers=args.workers,
                        pin_memory=True, prefetch_factor=4, persistent_workers=True)

    accum = args.global_bs // (args.micro_bs * world_size)
    assert accum >= 1 and accum * args.micro_bs * world_size == args.global_bs

    cfg = GPTBigCodeConfig(vocab_size=len(tok), n_positions=args.seq_len, n_embd=2048,
                           n_layer=24, n_head=16, multi_query=True)
    model = GPTBigCodeForCausalLM(cfg).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(s):
        if s < args.warmup:
            return args.lr * s / args.warmup
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - args.warmup) / (args.steps - args.warmup))))

    start = 0
    last = os.path.join(args.out, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location=device)
        model.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        start = ck["step"]
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=100)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world_size}, accum {accum}, {len(shards)} shards")

    it = iter(loader)
    model.train()
    t0 = time.time()
    for step in range(start, args.steps):
        for g in optim.param_groups:
            g["lr"] = lr_at(step)
        total = torch.zeros((), device=device)
        for k in range(accum):
            x = next(it).to(device, non_blocking=True)
            model.require_backward_grad_sync = (k == accum - 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

        if (step + 1) % 10 == 0:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / 10
                t0 = time.time()
                print(f"step {step + 1} loss {total.item():.4f} lr {lr_at(step):.2e} "
                      f"{args.global_bs * args.seq_len / dt / 1e6:.2f}M tok/s", flush=True)

        if (step + 1) % args.save_every == 0:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                            "step": step + 1}, last + ".tmp")
                os.replace(last + ".tmp", last)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
