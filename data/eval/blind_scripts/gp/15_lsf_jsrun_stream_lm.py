#!/usr/bin/env python3
"""Streaming LM training over jsonl shards on an LSF / jsrun machine (6 GPUs per node).

    #BSUB -P CSC999
    #BSUB -W 6:00
    #BSUB -nnodes 16
    #BSUB -J stream-lm
    #BSUB -o logs/stream-lm.%J
    module load open-ce/1.10
    jsrun -n 96 -a 1 -g 1 -c 7 --bind=none --smpiargs="-disable_gpu_hooks" \
        python stream_lm.py --shards '/gpfs/alpine/csc999/web_shards/*.jsonl.gz' --out /gpfs/alpine/csc999/runs/slm

jsrun gives each rank a single GPU (-g 1), so every process uses cuda:0.
The shards are the raw crawler dumps, tokenized on the fly.
"""
import argparse
import glob
import gzip
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel


def dist_env(port):
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    # the first entry of LSB_HOSTS is the launch node, not a compute node
    compute = [h for h in os.environ["LSB_HOSTS"].split() if not h.startswith(("batch", "login"))]
    os.environ["MASTER_ADDR"] = compute[0]
    os.environ["MASTER_PORT"] = str(port)
    return rank, world


class ShardStream(IterableDataset):
    def __init__(self, files, tokenizer, seq_len):
        self.files, self.tok, self.seq_len = files, tokenizer, seq_len

    def __iter__(self):
        wi = get_worker_info()
        files = self.files if wi is None else self.files[wi.id::wi.num_workers]
        buf = []
        for path in files:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                for line in f:
                    text = json.loads(line).get("text", "")
                    if len(text) < 200:
                        continue
                    buf.extend(self.tok(text)["input_ids"] + [self.tok.eos_token_id])
                    while len(buf) > self.seq_len:
                        chunk = torch.tensor(buf[: self.seq_len + 1])
                        buf = buf[self.seq_len:]
                        yield chunk[:-1], chunk[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default="gpt2")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=12, help="per GPU")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--port", type=int, default=29620)
    args = ap.parse_args()

    rank, world = dist_env(args.port)
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=rank, world_size=world)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    all_files = sorted(glob.glob(args.shards))
    my_files = all_files[rank::world]
    ds = ShardStream(my_files, tok, args.seq_len)
    dl = DataLoader(ds, batch_size=args.batch, num_workers=4, pin_memory=True, drop_last=True)

    cfg = GPT2Config(vocab_size=len(tok), n_positions=args.seq_len, n_embd=1024, n_layer=24, n_head=16)
    model = GPT2LMHeadModel(cfg).to(device)
    model = DDP(model, device_ids=[0])
    # 6 GPUs/node x 16 nodes x 12 = 1152 sequences per step; lr tuned for this size
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 2000
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} ranks, {len(all_files)} shards ({len(my_files)} on rank 0)", flush=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 100 == 0:
                lt = loss.detach().clone()
                dist.all_reduce(lt)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {(lt / world).item():.4f} "
                          f"{(time.time() - t0) / 100:.3f}s/step", flush=True)
                    t0 = time.time()
            if step % 5000 == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(args.out, f"step{step}.pt"))

        dist.barrier()
        if rank == 0:
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
            print(f"epoch {epoch} done at step {step}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
