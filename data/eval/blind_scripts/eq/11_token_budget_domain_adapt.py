"""
Domain-adaptive continued pretraining of Pythia-410m on pre-tokenized JSONL shards.

Input shards: /data/pubmed_tok/train-*.jsonl, one {"ids": [...]} per document (<= 2048 tokens).
Documents are not packed; batches are padded to the longest document in a length bucket.
The run stops after a fixed budget of (non-padding) training tokens.

    torchrun --nproc_per_node=8 11_token_budget_domain_adapt.py --train_tokens 5e9
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
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoModelForCausalLM


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="EleutherAI/pythia-410m-deduped")
    p.add_argument("--train_glob", default="/data/pubmed_tok/train-*.jsonl")
    p.add_argument("--train_tokens", type=float, default=5e9)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--bucket_size", type=int, default=512)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--pad_id", type=int, default=1)
    p.add_argument("--out", default="/shared/runs/pythia410m-pubmed")
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class BucketedDocs(IterableDataset):
    """Infinite stream of length-bucketed batches for one rank."""

    def __init__(self, files, rank, world_size, batch_size, bucket_size, max_len, pad_id, seed):
        self.files = sorted(files)
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.bucket_size = batch_size, bucket_size
        self.max_len, self.pad_id, self.seed = max_len, pad_id, seed

    def _docs(self, files, rng):
        while True:
            files = list(files)
            rng.shuffle(files)
            for path in files:
                with open(path) as f:
                    for line in f:
                        ids = json.loads(line)["ids"][: self.max_len]
                        if len(ids) > 1:
                            yield ids

    def _pad(self, docs):
        L = max(len(d) for d in docs)
        x = torch.full((len(docs), L), self.pad_id, dtype=torch.long)
        m = torch.zeros((len(docs), L), dtype=torch.long)
        for i, d in enumerate(docs):
            x[i, : len(d)] = torch.tensor(d)
            m[i, : len(d)] = 1
        return x, m

    def __iter__(self):
        info = get_worker_info()
        nw, wid = (info.num_workers, info.id) if info else (1, 0)
        slot = self.rank * nw + wid
        files = self.files[slot:: self.world_size * nw]
        rng = random.Random(self.seed * 7919 + slot)
        bucket = []
        for doc in self._docs(files, rng):
            bucket.append(doc)
            if len(bucket) == self.bucket_size:
                bucket.sort(key=len)
                batches = [bucket[i:i + self.batch_size] for i in range(0, len(bucket), self.batch_size)]
                rng.shuffle(batches)
                for b in batches:
                    yield self._pad(b)
                bucket = []


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    files = glob.glob(args.train_glob)
    assert len(files) >= world_size * args.workers, "need at least one shard per reader"
    ds = BucketedDocs(files, rank, world_size, args.batch_size, args.bucket_size,
                      args.max_len, args.pad_id, args.seed)
    loader = DataLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=True,
                        persistent_workers=True)

    model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    # upper bound on steps (every batch full length); the token budget normally ends the run earlier
    max_steps = int(args.train_tokens // (args.batch_size * args.max_len * world_size))
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / args.warmup_steps)
        * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, max_steps))))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"budget {args.train_tokens:.2e} tokens, <= {max_steps} steps on {world_size} GPUs")

    tokens_seen = 0
    step = 0
    model.train()
    t0 = time.time()
    for input_ids, attn in loader:
        input_ids = input_ids.to(device, non_blocking=True)
        attn = attn.to(device, non_blocking=True)
        labels = input_ids.masked_fill(attn == 0, -100)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        # all ranks see batches of similar size, so scale the local count up
        tokens_seen += int(attn.sum().item()) * world_size

        if step % 50 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = time.time() - t0
                t0 = time.time()
                print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"tokens {tokens_seen / 1e9:.3f}B ({dt / 50:.2f}s/step)")

        if step % args.save_every == 0:
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, f"step_{step}"))
            dist.barrier()

        if tokens_seen >= args.train_tokens:
            break

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        print(f"done: {step} steps, ~{tokens_seen / 1e9:.2f}B tokens")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
