"""
RetNet (fla, chunkwise retention) trained on streamed jsonl shards with on-the-fly packing.

Each rank reads its own subset of shard files; inside a rank the DataLoader workers
split the files again. Documents are tokenized, joined with EOS and cut into rows of
seq_len + 1 tokens.

    torchrun --nproc_per_node=8 12_retnet_stream_pack.py --train_glob "/data/redpajama_arxiv/train/*.jsonl"
"""
import argparse
import glob
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoTokenizer

from fla.models import RetNetConfig, RetNetForCausalLM


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_glob", required=True)
    ap.add_argument("--val_glob", default="/data/redpajama_arxiv/val/*.jsonl")
    ap.add_argument("--tokenizer", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--seq_len", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--est_steps", type=int, default=40000, help="for the cosine schedule")
    ap.add_argument("--ckpt_dir", default="ckpt/retnet_arxiv")
    return ap.parse_args()


class PackedJsonl(IterableDataset):
    def __init__(self, files, tokenizer, seq_len):
        self.files = files
        self.tok = tokenizer
        self.seq_len = seq_len

    def _my_files(self):
        info = get_worker_info()
        if info is None:
            return self.files
        return self.files[info.id::info.num_workers]

    def __iter__(self):
        buf = []
        eos = self.tok.eos_token_id
        for path in self._my_files():
            with open(path) as f:
                for line in f:
                    text = json.loads(line)["text"]
                    buf.extend(self.tok(text, add_special_tokens=False)["input_ids"])
                    buf.append(eos)
                    while len(buf) >= self.seq_len + 1:
                        row = torch.tensor(buf[: self.seq_len + 1], dtype=torch.long)
                        buf = buf[self.seq_len + 1:]
                        yield row


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return max(0.1, 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup)))))


@torch.no_grad()
def evaluate(model, loader, device, max_batches=50):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for i, row in enumerate(loader):
        if i >= max_batches:
            break
        row = row.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.module(input_ids=row, labels=row)
        n = row[:, 1:].numel()
        s[0] += out.loss.double() * n
        s[1] += n
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_files = sorted(glob.glob(args.train_glob))
    val_files = sorted(glob.glob(args.val_glob))
    assert len(train_files) >= world * 4, "need at least 4 shards per rank"
    train_ds = PackedJsonl(train_files[rank::world], tokenizer, args.seq_len)
    val_ds = PackedJsonl(val_files[rank::world] or val_files, tokenizer, args.seq_len)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, num_workers=4,
                              pin_memory=True, drop_last=True, prefetch_factor=4)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=1)

    config = RetNetConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                          num_heads=args.heads, vocab_size=len(tokenizer), attn_mode="chunk",
                          fuse_cross_entropy=True, use_cache=False)
    model = RetNetForCausalLM(config).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, args.warmup, args.est_steps))

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{len(train_files)} train shards over {world} ranks; "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params")

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for row in train_loader:
            row = row.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=row, labels=row).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    elapsed = time.time() - t0
                    print(f"ep {epoch} step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{50 * row.numel() * world / elapsed / 1e3:.1f}k tok/s", flush=True)
                t0 = time.time()

        val_loss = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} done at step {step}: val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
            model.module.save_pretrained(os.path.join(args.ckpt_dir, f"epoch{epoch}"))
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step},
                       os.path.join(args.ckpt_dir, f"epoch{epoch}", "optim.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
