"""Continued pretraining of a small Llama on a domain corpus.

Launch (one node, 8 GPUs):
    torchrun --nproc_per_node=8 03_llama_continued_pretrain.py \
        --model meta-llama/Llama-3.2-1B --corpus /data/legal_corpus --out /shared/ckpt/llama1b-legal
"""
import argparse
import glob
import logging
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger("cpt")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    p.add_argument("--corpus", required=True, help="directory of .txt files")
    p.add_argument("--out", required=True)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--micro_bs", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--val_frac", type=float, default=0.005)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def build_token_cache(corpus_dir, tokenizer, seq_len):
    """Tokenize every document once, concatenate with EOS and store as uint32 .npy next to the corpus."""
    cache = os.path.join(corpus_dir, f"tokens_{tokenizer.name_or_path.replace('/', '_')}_{seq_len}.npy")
    if os.path.exists(cache):
        return np.load(cache, mmap_mode="r")
    files = sorted(glob.glob(os.path.join(corpus_dir, "**", "*.txt"), recursive=True))
    ids = []
    for path in files:
        with open(path, encoding="utf-8", errors="ignore") as f:
            text = f.read()
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = (len(ids) // (seq_len + 1)) * (seq_len + 1)
    arr = np.asarray(ids[:n], dtype=np.uint32)
    np.save(cache, arr)
    return np.load(cache, mmap_mode="r")


class PackedBlocks(Dataset):
    def __init__(self, tokens, seq_len, start_block, end_block):
        self.tokens = tokens
        self.seq_len = seq_len
        self.start = start_block
        self.n = end_block - start_block

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        off = (self.start + i) * (self.seq_len + 1)
        chunk = torch.from_numpy(self.tokens[off : off + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum"
        )
        tot[0] += loss
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens = build_token_cache(args.corpus, tokenizer, args.seq_len)
    n_blocks = len(tokens) // (args.seq_len + 1)
    n_val = max(world, int(n_blocks * args.val_frac))
    train_ds = PackedBlocks(tokens, args.seq_len, 0, n_blocks - n_val)
    val_ds = PackedBlocks(tokens, args.seq_len, n_blocks - n_val, n_blocks)
    logger.info("blocks: train %d val %d (%.2fB tokens)", len(train_ds), len(val_ds),
                len(tokens) / 1e9)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True,
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_bs, sampler=val_sampler,
                        num_workers=2, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True,
                    bucket_cap_mb=200)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=True)
    total_steps = args.epochs * len(train_dl) // args.grad_accum
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, args.warmup, total_steps))

    tokens_per_step = args.micro_bs * args.seq_len * args.grad_accum * world
    step = 0
    t_last = time.perf_counter()
    loss_acc = torch.zeros((), device=device)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            is_update = (i + 1) % args.grad_accum == 0
            ctx = ddp_model.no_sync() if not is_update else nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    # targets are pre-shifted, so compute the loss here instead of passing labels=
                    logits = ddp_model(input_ids=x).logits
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                (loss / args.grad_accum).backward()
            loss_acc += loss.detach() / args.grad_accum
            if not is_update:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                torch.cuda.synchronize()
                now = time.perf_counter()
                tps = tokens_per_step * args.log_every / (now - t_last)
                t_last = now
                logger.info("ep %d step %d/%d loss %.4f lr %.2e %.0f tok/s (%.0f tok/s/gpu)",
                            epoch, step, total_steps, loss_acc.item() / args.log_every,
                            sched.get_last_lr()[0], tps, tps / world)
                loss_acc.zero_()

            if step % args.save_every == 0:
                val_loss = validate(ddp_model, val_dl, device)
                logger.info("step %d val loss %.4f ppl %.2f", step, val_loss, math.exp(val_loss))
                if rank == 0:
                    save_dir = os.path.join(args.out, f"step_{step}")
                    model.save_pretrained(save_dir, safe_serialization=True)
                    tokenizer.save_pretrained(save_dir)
                    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step},
                               os.path.join(save_dir, "trainer_state.pt"))
                dist.barrier()

    val_loss = validate(ddp_model, val_dl, device)
    if rank == 0:
        logger.info("final val loss %.4f", val_loss)
        model.save_pretrained(os.path.join(args.out, "final"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
