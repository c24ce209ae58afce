"""
Code-LM pretraining (GPT-NeoX style, 350M) on pre-tokenized shards, epoch based.

Shards: <data>/train/*.npy  (uint16 1-D token arrays, one per source repo bucket)
        <data>/val.npy

    torchrun --nproc_per_node=8 08_gpt_stream_epochs.py --data /data/stack_py_tok --epochs 3
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM


class ShardedTokens(IterableDataset):
    def __init__(self, files, seq_len, seed, shuffle=True):
        super().__init__()
        self.files = files
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        files = list(self.files)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(files)
        if info is not None:
            files = files[info.id::info.num_workers]
        for path in files:
            arr = np.load(path, mmap_mode="r")
            n = (len(arr) - 1) // self.seq_len
            order = np.arange(n)
            if self.shuffle:
                np.random.default_rng(self.seed + self.epoch).shuffle(order)
            for i in order:
                s = i * self.seq_len
                yield torch.from_numpy(arr[s:s + self.seq_len + 1].astype(np.int64))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="ckpt/neox-350m")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=1500)
    p.add_argument("--est_total_steps", type=int, default=60000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--eval_batches", type=int, default=50)
    return p.parse_args()


@torch.no_grad()
def validate(model, val_arr, seq_len, batches, micro, rank, world, device):
    model.eval()
    n = (len(val_arr) - 1) // seq_len
    idx = np.arange(rank, n, world)[: batches * micro]
    loss_sum = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for j in range(0, len(idx), micro):
        rows = [torch.from_numpy(val_arr[i * seq_len:i * seq_len + seq_len + 1].astype(np.int64))
                for i in idx[j:j + micro]]
        b = torch.stack(rows).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=b[:, :-1]).logits
        loss_sum += F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten(), reduction="sum")
        count += b[:, 1:].numel()
    dist.all_reduce(loss_sum)
    dist.all_reduce(count)
    model.train()
    return (loss_sum / count).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.manual_seed(42)

    files = sorted(glob.glob(os.path.join(args.data, "train", "*.npy")))
    my_files = files[rank::world]
    train_ds = ShardedTokens(my_files, args.seq_len, seed=1234)
    loader = DataLoader(train_ds, batch_size=args.micro_batch, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    val_arr = np.load(os.path.join(args.data, "val.npy"), mmap_mode="r")

    config = GPTNeoXConfig(vocab_size=50304, hidden_size=1024, num_hidden_layers=24,
                           num_attention_heads=16, intermediate_size=4096,
                           max_position_embeddings=args.seq_len, rotary_pct=0.25,
                           use_parallel_residual=True)
    model = GPTNeoXForCausalLM(config).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)

    def lr_lambda(s):
        if s < args.warmup:
            return (s + 1) / args.warmup
        prog = min(1.0, (s - args.warmup) / max(1, args.est_total_steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(files)} shards, {len(my_files)} on rank 0; "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params")

    step = 0
    for epoch in range(args.epochs):
        train_ds.set_epoch(epoch)
        t0 = time.time()
        tokens = 0
        for micro, batch in enumerate(loader):
            batch = batch.to(device, non_blocking=True)
            inp, tgt = batch[:, :-1], batch[:, 1:]
            last = (micro + 1) % args.accum == 0
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(input_ids=inp).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten()) / args.accum
                loss.backward()
            tokens += tgt.numel()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0 and rank == 0:
                dt = time.time() - t0
                print(f"ep {epoch} step {step} loss {loss.item() * args.accum:.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {tokens * world / dt:,.0f} tok/s", flush=True)
                t0, tokens = time.time(), 0
            if step % 2000 == 0:
                vl = validate(model, val_arr, args.seq_len, args.eval_batches, args.micro_batch,
                              rank, world, device)
                if rank == 0:
                    print(f"step {step} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

        if rank == 0:
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                        "epoch": epoch}, os.path.join(args.out, f"epoch{epoch}", "train_state.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
