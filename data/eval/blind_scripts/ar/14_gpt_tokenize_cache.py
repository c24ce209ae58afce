"""Domain-adaptive GPT pretraining from raw jsonl: tokenizes once into a uint16 cache, then trains.

    torchrun --nproc_per_node=8 14_gpt_tokenize_cache.py --jsonl /data/legal/*.jsonl \
        --cache_dir /data/legal/cache --out runs/legal-gpt
"""
import argparse
import glob
import json
import math
import os
import time

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--jsonl", nargs="+", required=True)
    p.add_argument("--cache_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--val_fraction", type=float, default=0.005)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--eval_every", type=int, default=1000)
    return p.parse_args()


def build_token_cache(files, cache_dir, val_fraction):
    """Tokenize all documents with the GPT-2 BPE and write train.bin / val.bin (uint16)."""
    enc = tiktoken.get_encoding("gpt2")
    paths = sorted(p for pattern in files for p in glob.glob(pattern))
    docs = []
    for path in paths:
        with open(path) as f:
            for line in f:
                text = json.loads(line).get("text", "")
                if text:
                    docs.append(text)
    n_val = max(1, int(len(docs) * val_fraction))
    splits = {"val": docs[:n_val], "train": docs[n_val:]}
    os.makedirs(cache_dir, exist_ok=True)
    for split, texts in splits.items():
        ids = enc.encode_ordinary_batch(texts, num_threads=16)
        total = sum(len(x) + 1 for x in ids)
        arr = np.memmap(os.path.join(cache_dir, f"{split}.bin"), dtype=np.uint16, mode="w+", shape=(total,))
        pos = 0
        for x in ids:
            arr[pos:pos + len(x)] = x
            arr[pos + len(x)] = enc.eot_token
            pos += len(x) + 1
        arr.flush()
        del arr


class Chunks(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        return torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))


def main():
    args = parse()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_bin = os.path.join(args.cache_dir, "train.bin")
    val_bin = os.path.join(args.cache_dir, "val.bin")
    if not (os.path.exists(train_bin) and os.path.exists(val_bin)):
        print(f"[rank {rank}] building token cache in {args.cache_dir}", flush=True)
        build_token_cache(args.jsonl, args.cache_dir, args.val_fraction)
    dist.barrier()

    train_ds = Chunks(train_bin, args.seq_len)
    val_ds = Chunks(val_bin, args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch, num_workers=2,
                            sampler=DistributedSampler(val_ds, shuffle=False))

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=args.seq_len, n_embd=1024, n_layer=24, n_head=16)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = args.epochs * len(loader) // args.accum

    def lr_lambda(s):
        if s < args.warmup:
            return (s + 1) / args.warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / (total_steps - args.warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train seqs {len(train_ds)}, val seqs {len(val_ds)}, {total_steps} optimizer steps")

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(loader):
            batch = batch.to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0
            model.require_backward_grad_sync = sync
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss / args.accum
            scaler.scale(loss).backward()
            if not sync:
                continue
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0 and rank == 0:
                dt, t0 = time.time() - t0, time.time()
                tok = 50 * args.batch * args.accum * args.seq_len * world
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item() * args.accum:.4f} "
                      f"scale {scaler.get_scale():.0f} {tok / dt:,.0f} tok/s", flush=True)

            if step % args.eval_every == 0:
                model.eval()
                tot = torch.zeros(2, device=device)
                with torch.no_grad():
                    for vb in val_loader:
                        vb = vb.to(device)
                        with torch.autocast("cuda", dtype=torch.float16):
                            vl = model(input_ids=vb[:, :-1], labels=vb[:, :-1]).loss
                        tot += torch.stack([vl.float() * vb.size(0), torch.tensor(float(vb.size(0)), device=device)])
                dist.all_reduce(tot)
                model.train()
                if rank == 0:
                    v = (tot[0] / tot[1]).item()
                    print(f"step {step} val loss {v:.4f} ppl {math.exp(v):.2f}", flush=True)

        if rank == 0:
            model.module.save_pretrained(os.path.join(args.out, f"epoch-{epoch}"))
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                        "step": step, "epoch": epoch + 1}, os.path.join(args.out, f"epoch-{epoch}", "state.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
