"""Code-LM continued training with FSDP2 over streamed jsonl shards.

The corpus is ~1.2k jsonl files ({"content": ...} per line) produced by the
dedup pipeline. Files are streamed and packed into fixed-length sequences on
the fly, so nothing has to be pre-tokenized.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        08_code_lm_fsdp2_streaming.py --shards '/lustre/code/dedup_v3/*.jsonl' --init /lustre/ckpt/base-3b/dcp
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
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--out", default="/lustre/ckpt/code-3b")
    p.add_argument("--tokenizer", default="bigcode/starcoder2-3b")
    p.add_argument("--dim", type=int, default=2560)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--est-steps", type=int, default=20000, help="for the cosine schedule")
    p.add_argument("--save-every", type=int, default=1000)
    return p.parse_args()


class PackedJsonl(IterableDataset):
    def __init__(self, files, tokenizer, seq, seed):
        self.files, self.tok, self.seq, self.seed = files, tokenizer, seq, seed
        self.epoch = 0

    def set_epoch(self, e):
        self.epoch = e

    def __iter__(self):
        files = list(self.files)
        random.Random(self.seed + self.epoch).shuffle(files)
        wi = get_worker_info()
        if wi is not None:
            files = files[wi.id::wi.num_workers]
        buf = []
        eos = self.tok.eos_token_id
        for fn in files:
            with open(fn) as f:
                for line in f:
                    buf.extend(self.tok(json.loads(line)["content"])["input_ids"] + [eos])
                    while len(buf) >= self.seq + 1:
                        chunk = torch.tensor(buf[:self.seq + 1], dtype=torch.long)
                        buf = buf[self.seq + 1:]
                        yield chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.n1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=True)
        self.o = nn.Linear(d, d, bias=True)
        self.n2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=True)
        self.down = nn.Linear(4 * d, d, bias=True)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, D // self.h).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.n2(x)), approximate="tanh"))


class CodeLM(nn.Module):
    def __init__(self, vocab, d, layers, h, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    r = min(1.0, (step - args.warmup) / max(1, args.est_steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * r)))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    all_files = sorted(glob.glob(args.shards))
    my_files = all_files[rank::world]
    ds = PackedJsonl(my_files, tok, args.seq, seed=17)
    loader = DataLoader(ds, batch_size=args.mbs, num_workers=4, pin_memory=True, prefetch_factor=4)
    if rank == 0:
        print(f"{len(all_files)} shards over {world} ranks (~{len(my_files)} per rank)", flush=True)

    with torch.device("meta"):
        model = CodeLM(len(tok), args.dim, args.layers, args.heads, args.seq)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, blk in enumerate(model.blocks):
        blk = checkpoint_wrapper(blk)
        fully_shard(blk, mp_policy=mp)
        model.blocks[i] = blk
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=dev)
    init_sd = get_model_state_dict(model)
    dcp.load({"model": init_sd}, checkpoint_id=args.init)
    set_model_state_dict(model, init_sd)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    step = 0
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                stats = torch.stack([loss.detach().float(), gnorm.float()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = 20 * args.mbs * args.seq * world / (time.time() - t0)
                    print(f"ep {epoch} step {step} loss {stats[0]:.4f} gnorm {stats[1]:.2f} "
                          f"lr {lr_at(step, args):.2e} {tps / 1e6:.2f}M tok/s", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.out, f"step_{step}"))

        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.out, f"epoch_{epoch}"))
        if rank == 0:
            print(f"finished epoch {epoch} at step {step}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
