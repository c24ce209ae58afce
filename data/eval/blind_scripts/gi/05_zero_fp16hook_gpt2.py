"""GPT-2 medium pretraining on OpenWebText with ZeroRedundancyOptimizer + fp16 gradient compression.

Optimizer states (AdamW moments) are sharded across ranks with ZeRO stage 1,
and DDP's all-reduce sends fp16 gradients (fp16_compress_hook) to halve traffic
on our 25GbE boxes.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node01:29400 \
    05_zero_fp16hook_gpt2.py --data_dir /shared/owt --out_dir /shared/ckpt/gpt2m_zero
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel

logger = logging.getLogger("gpt2_zero")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", type=str, required=True)
    p.add_argument("--out_dir", type=str, required=True)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--max_steps", type=int, default=200_000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min_lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--eval_interval", type=int, default=1000)
    p.add_argument("--eval_iters", type=int, default=50)
    p.add_argument("--ckpt_interval", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class TokenStream:
    def __init__(self, path, block_size, micro_batch, seed):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size
        self.micro_batch = micro_batch
        self.gen = np.random.default_rng(seed)

    def batch(self, device):
        ix = self.gen.integers(0, len(self.data) - self.block_size - 1, size=self.micro_batch)
        x = np.stack([self.data[i:i + self.block_size] for i in ix]).astype(np.int64)
        y = np.stack([self.data[i + 1:i + 1 + self.block_size] for i in ix]).astype(np.int64)
        x = torch.from_numpy(x).pin_memory().to(device, non_blocking=True)
        y = torch.from_numpy(y).pin_memory().to(device, non_blocking=True)
        return x, y


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = min(1.0, (step - args.warmup) / (args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_loss(model, stream, iters, device):
    model.eval()
    total = torch.zeros(1, device=device)
    for _ in range(iters):
        x, y = stream.batch(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total += model(input_ids=x, labels=y).loss
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    model.train()
    return total.item() / iters


def save_checkpoint(model, optimizer, step, args, rank):
    if rank == 0:
        optimizer.consolidate_state_dict(to=0)
        path = os.path.join(args.out_dir, f"step_{step:07d}.pt")
        torch.save({
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "config": model.module.config.to_dict(),
        }, path)
        logger.info("saved %s", path)
    dist.barrier()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    torch.manual_seed(args.seed)
    config = GPT2Config(n_positions=args.block_size, n_embd=1024, n_layer=24, n_head=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(device)
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=50)
    model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = ZeroRedundancyOptimizer(
        decay,
        optimizer_class=torch.optim.AdamW,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=args.weight_decay,
        parameters_as_bucket_view=True,
    )
    optimizer.add_param_group({"params": no_decay, "weight_decay": 0.0})

    train = TokenStream(os.path.join(args.data_dir, "train.bin"), args.block_size, args.micro_batch,
                        seed=args.seed + rank)
    val = TokenStream(os.path.join(args.data_dir, "val.bin"), args.block_size, args.micro_batch,
                      seed=10_000 + rank)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        n = sum(p.numel() for p in model.parameters())
        tokens_per_step = args.micro_batch * args.grad_accum * args.block_size * world
        logger.info("params %.1fM, tokens/step %d", n / 1e6, tokens_per_step)

    model.train()
    t0 = time.time()
    for step in range(args.max_steps):
        lr = lr_at(step, args)
        for g in optimizer.param_groups:
            g["lr"] = lr

        for micro in range(args.grad_accum):
            x, y = train.batch(device)
            sync = micro == args.grad_accum - 1
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=y).loss / args.grad_accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % 20 == 0 and rank == 0:
            dt = time.time() - t0
            t0 = time.time()
            logger.info("step %d loss %.4f lr %.2e %.2fs/20 steps", step, loss.item() * args.grad_accum, lr, dt)

        if step > 0 and step % args.eval_interval == 0:
            val_loss = estimate_loss(model, val, args.eval_iters, device)
            logger.info("step %d val_loss %.4f ppl %.2f", step, val_loss, math.exp(val_loss))

        if step > 0 and step % args.ckpt_interval == 0:
            save_checkpoint(model, optimizer, step, args, rank)

    save_checkpoint(model, optimizer, args.max_steps, args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
