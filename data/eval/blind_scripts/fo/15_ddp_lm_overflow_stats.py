#!/usr/bin/env python
"""GPT-2 medium language model trained from scratch on a code corpus.
DDP, fp16 autocast + GradScaler with overflow tracking, gradient accumulation,
periodic validation perplexity.

    torchrun --nproc_per_node=8 15_ddp_lm_overflow_stats.py --train /data/code/train.npy --valid /data/code/valid.npy
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

try:
    import wandb
except ImportError:
    wandb = None


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--bsz", type=int, default=8)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max_updates", type=int, default=150000)
    p.add_argument("--eval_interval", type=int, default=2500)
    p.add_argument("--log_interval", type=int, default=50)
    p.add_argument("--ckpt", default="ckpt/gpt2m_code")
    p.add_argument("--wandb_project", default=None)
    return p.parse_args()


class Windows(Dataset):
    def __init__(self, path, ctx):
        self.tokens = np.load(path, mmap_mode="r")
        self.ctx = ctx

    def __len__(self):
        return (len(self.tokens) - 1) // self.ctx

    def __getitem__(self, i):
        w = np.asarray(self.tokens[i * self.ctx : (i + 1) * self.ctx + 1], dtype=np.int64)
        return torch.from_numpy(w)


def lr_schedule(u, args):
    if u < args.warmup:
        return (u + 1) / args.warmup
    progress = (u - args.warmup) / max(1, args.max_updates - args.warmup)
    return max(0.1, 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def validate(model, loader, device, max_batches=200):
    model.eval()
    loss_sum, n_tok = 0.0, 0
    for b, w in enumerate(loader):
        if b >= max_batches:
            break
        w = w.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(w[:, :-1]).logits
        loss_sum += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        n_tok += w[:, 1:].numel()
    totals = torch.tensor([loss_sum, n_tok], dtype=torch.float64)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    use_wandb = rank == 0 and wandb is not None and args.wandb_project
    if use_wandb:
        wandb.init(project=args.wandb_project, config=vars(args))

    train_ds, valid_ds = Windows(args.train, args.ctx), Windows(args.valid, args.ctx)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bsz, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.bsz, sampler=valid_sampler, num_workers=2)

    config = GPT2Config(vocab_size=50304, n_positions=args.ctx, n_embd=1024, n_layer=24, n_head=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: lr_schedule(u, args))
    scaler = torch.cuda.amp.GradScaler()

    updates, skipped, epoch = 0, 0, 0
    t_last = time.time()
    best_val = float("inf")
    while updates < args.max_updates:
        train_sampler.set_epoch(epoch)
        for i, w in enumerate(train_dl):
            w = w.to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(w[:, :-1]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
                scaler.scale(loss / args.accum).backward()
            if not sync:
                continue

            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            old_scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if scaler.get_scale() < old_scale:
                skipped += 1  # overflow: optimizer.step was skipped on every rank
            else:
                scheduler.step()
            updates += 1

            if updates % args.log_interval == 0 and rank == 0:
                dt = (time.time() - t_last) / args.log_interval
                t_last = time.time()
                print(f"upd {updates} loss {loss.item():.4f} gnorm {gnorm.item():.2f} "
                      f"scale {scaler.get_scale():.0f} skipped {skipped} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{dt:.2f}s/upd", flush=True)
                if use_wandb:
                    wandb.log({"train/loss": loss.item(), "train/grad_norm": gnorm.item(),
                               "train/loss_scale": scaler.get_scale(), "train/skipped": skipped}, step=updates)

            if updates % args.eval_interval == 0:
                val_loss = validate(model, valid_dl, device)
                if rank == 0:
                    print(f"upd {updates} valid loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
                    if use_wandb:
                        wandb.log({"valid/loss": val_loss, "valid/ppl": math.exp(val_loss)}, step=updates)
                    os.makedirs(args.ckpt, exist_ok=True)
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict(),
                             "updates": updates}
                    torch.save(state, os.path.join(args.ckpt, "last.pt"))
                    if val_loss < best_val:
                        best_val = val_loss
                        torch.save(model.module.state_dict(), os.path.join(args.ckpt, "best.pt"))
                dist.barrier()
            if updates >= args.max_updates:
                break
        epoch += 1

    if use_wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
