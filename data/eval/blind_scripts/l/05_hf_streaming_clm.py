#!/usr/bin/env python
# Continued pretraining of a ~0.5B causal LM on a streamed web corpus (no local copy).
# launch:
#   torchrun --nnodes=1 --nproc_per_node=8 05_hf_streaming_clm.py \
#       --model Qwen/Qwen2.5-0.5B --dataset HuggingFaceFW/fineweb-edu --subset sample-10BT
import argparse
import itertools
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoModelForCausalLM, AutoTokenizer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class PackedStream(IterableDataset):
    """Concatenate tokenized docs with EOS and cut into fixed blocks."""

    def __init__(self, hf_stream, tokenizer, block_size):
        self.stream = hf_stream
        self.tok = tokenizer
        self.block = block_size

    def set_epoch(self, epoch):
        self.stream.set_epoch(epoch)

    def __iter__(self):
        buf = []
        for ex in self.stream:
            ids = self.tok(ex["text"], add_special_tokens=False)["input_ids"]
            buf.extend(ids + [self.tok.eos_token_id])
            while len(buf) >= self.block + 1:
                chunk = torch.tensor(buf[: self.block + 1], dtype=torch.long)
                buf = buf[self.block:]
                yield {"input_ids": chunk[:-1], "labels": chunk[1:]}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    p.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu")
    p.add_argument("--subset", default="sample-10BT")
    p.add_argument("--block_size", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--max_steps", type=int, default=20000)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--out", default="ckpt/clm_stream")
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * step / args.warmup
    t = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * t))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    stream = load_dataset(args.dataset, name=args.subset, split="train", streaming=True)
    stream = stream.select_columns(["text"]).shuffle(seed=args.seed, buffer_size=10_000)
    train_ds = PackedStream(stream, tok, args.block_size)
    loader = DataLoader(train_ds, batch_size=args.batch_size, num_workers=args.num_workers,
                        pin_memory=True, prefetch_factor=4)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                              weight_decay=0.1, fused=True)

    if rank == 0:
        print(f"world_size={world_size} tokens/step="
              f"{args.batch_size * args.accum * args.block_size * world_size:,}", flush=True)

    model.train()
    step, micro = 0, 0
    epoch = 0
    t0 = time.time()
    loss_sum = torch.zeros((), device=device)
    data_iter = iter(loader)
    while step < args.max_steps:
        try:
            batch = next(data_iter)
        except StopIteration:
            epoch += 1
            train_ds.set_epoch(epoch)
            data_iter = iter(loader)
            batch = next(data_iter)

        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        sync = (micro + 1) % args.accum == 0
        ctx = model.no_sync() if not sync else _nullctx()
        with ctx:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=input_ids).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().view(-1, logits.size(-1)), labels.view(-1))
            (loss / args.accum).backward()
        loss_sum += loss.detach() / args.accum
        micro += 1
        if not sync:
            continue

        for g in optim.param_groups:
            g["lr"] = lr_at(step, args)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1

        if step % 25 == 0:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            if rank == 0:
                el = time.time() - t0
                print(f"step {step} loss {loss_sum.item() / 25:.4f} "
                      f"lr {optim.param_groups[0]['lr']:.2e} {el / 25:.2f}s/step", flush=True)
            loss_sum.zero_()
            t0 = time.time()

        if step % args.save_every == 0:
            if rank == 0:
                save_dir = os.path.join(args.out, f"step_{step}")
                model.module.save_pretrained(save_dir)
                tok.save_pretrained(save_dir)
            dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
