"""
Domain-adaptive pre-training of OPT-1.3B on 4 x RTX 3090 (24 GB).

Fits with: bf16 autocast, activation checkpointing, 8-bit AdamW (bitsandbytes),
micro-batch 4 and 16 accumulation steps. Runs are preemptible, so the script saves a
resumable checkpoint every --save_interval optimizer steps.

    torchrun --nproc_per_node 4 08_ddp_gradaccum_resume.py --data_dir /data/pubmed_tok \
        --resume runs/opt13b/latest.pt
"""
import argparse
import contextlib
import glob
import math
import os
import time

import bitsandbytes as bnb
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM


class PackedTokens(Dataset):
    """Pre-tokenised uint16 shards written by tokenize_pubmed.py, read through np.memmap."""

    def __init__(self, data_dir, seq_len):
        self.seq_len = seq_len
        self.shards = [np.memmap(f, dtype=np.uint16, mode="r") for f in sorted(glob.glob(os.path.join(data_dir, "*.bin")))]
        self.index = []
        for s_id, arr in enumerate(self.shards):
            n = (len(arr) - 1) // seq_len
            self.index.extend((s_id, i * seq_len) for i in range(n))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s_id, off = self.index[i]
        chunk = torch.from_numpy(self.shards[s_id][off : off + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="facebook/opt-1.3b")
    p.add_argument("--data_dir", required=True)
    p.add_argument("--val_dir", default=None)
    p.add_argument("--out_dir", default="runs/opt13b")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_bs", type=int, default=4)
    p.add_argument("--accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-5)
    p.add_argument("--min_lr", type=float, default=6e-6)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--max_steps", type=int, default=20000)
    p.add_argument("--save_interval", type=int, default=250)
    p.add_argument("--resume", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * ratio))


def infinite(loader, sampler, start_epoch):
    epoch = start_epoch
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


@torch.no_grad()
def val_loss(model, loader, device, max_batches=50):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i == max_batches:
            break
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        tot[0] += torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        tot[1] += 1
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)

    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    step, epoch = 0, 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, epoch = ckpt["step"], ckpt["epoch"]
        torch.set_rng_state(ckpt["cpu_rng"])
        del ckpt
        if rank == 0:
            print(f"resumed at step {step}", flush=True)

    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True, static_graph=True)

    train_ds = PackedTokens(args.data_dir, args.seq_len)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = None
    if args.val_dir:
        val_ds = PackedTokens(args.val_dir, args.seq_len)
        val_loader = DataLoader(val_ds, batch_size=args.micro_bs,
                                sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)

    writer = SummaryWriter(os.path.join(args.out_dir, "tb")) if rank == 0 else None
    data_iter = infinite(loader, sampler, epoch)
    model.train()
    t0 = time.time()
    while step < args.max_steps:
        lr = lr_at(step, args)
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss_acc = torch.zeros((), device=device)
        for micro in range(args.accum):
            epoch, (x, y) = next(data_iter)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            ctx = model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(input_ids=x).logits
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                (loss / args.accum).backward()
            loss_acc += loss.detach() / args.accum
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / 10
                tok_s = args.micro_bs * args.accum * args.seq_len * world / dt
                print(f"step {step} loss {loss_acc.item():.4f} lr {lr:.2e} gnorm {gnorm:.2f} {tok_s:.0f} tok/s",
                      flush=True)
                writer.add_scalar("train/loss", loss_acc.item(), step)
                writer.add_scalar("train/lr", lr, step)
            t0 = time.time()

        if val_loader is not None and step % 1000 == 0:
            vl = val_loss(model, val_loader, device)
            if rank == 0:
                writer.add_scalar("val/loss", vl, step)
                print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

        if step % args.save_interval == 0 or step == args.max_steps:
            if rank == 0:
                os.makedirs(args.out_dir, exist_ok=True)
                tmp = os.path.join(args.out_dir, "latest.pt.tmp")
                torch.save({
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "epoch": epoch,
                    "cpu_rng": torch.get_rng_state(),
                }, tmp)
                os.replace(tmp, os.path.join(args.out_dir, "latest.pt"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
