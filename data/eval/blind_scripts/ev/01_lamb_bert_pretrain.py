#!/usr/bin/env python
"""Masked-LM pretraining with LAMB for the large-batch scaling study.

One process per GPU, launched with torchrun. Data is a pre-tokenized uint16
token stream (see tools/tokenize_corpus.py), cut into fixed-length blocks.
"""
import argparse
import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("lamb_mlm")


class Lamb(Optimizer):
    """LAMB (You et al., 2019) with bias correction; trust ratio clamped to [0, clamp_value]."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, clamp_value=10.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.clamp_value = clamp_value
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                bc1 = 1 - beta1 ** state["step"]
                bc2 = 1 - beta2 ** state["step"]
                update = (exp_avg / bc1) / (exp_avg_sq / bc2).sqrt().add_(group["eps"])
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm = p.norm(2)
                u_norm = update.norm(2)
                trust = torch.where(
                    (w_norm > 0) & (u_norm > 0),
                    (w_norm / u_norm).clamp(max=self.clamp_value),
                    torch.ones_like(w_norm),
                )
                p.add_(update * (-group["lr"] * trust))
        return loss


class MaskedBlocks(Dataset):
    def __init__(self, path, seq_len, vocab_size, mask_id, mask_prob=0.15):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.mask_id = mask_id
        self.mask_prob = mask_prob
        self.n_blocks = len(self.data) // seq_len

    def __len__(self):
        return self.n_blocks

    def __getitem__(self, idx):
        s = idx * self.seq_len
        x = torch.from_numpy(self.data[s:s + self.seq_len].astype(np.int64))
        labels = x.clone()
        masked = torch.rand(self.seq_len) < self.mask_prob
        labels[~masked] = -100
        r = torch.rand(self.seq_len)
        x[masked & (r < 0.8)] = self.mask_id
        swap = masked & (r >= 0.8) & (r < 0.9)
        x[swap] = torch.randint(self.vocab_size, (int(swap.sum()),))
        return x, labels


class Encoder(nn.Module):
    def __init__(self, vocab_size, d_model, n_layers, n_heads, seq_len, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, x):
        pos = torch.arange(x.size(1), device=x.device)
        h = self.tok(x) + self.pos(pos)
        h = self.encoder(h)
        return self.lm_head(self.norm(h))

    def param_groups(self, weight_decay):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if p.ndim < 2 or "norm" in name or name.endswith(".bias"):
                no_decay.append(p)
            else:
                decay.append(p)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", required=True)
    p.add_argument("--val-data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--mask-id", type=int, default=103)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=128, help="per-GPU micro batch")
    p.add_argument("--lr", type=float, default=6e-3, help="peak LR for the global batch")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-frac", type=float, default=0.2843)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--resume", default="")
    return p.parse_args()


def poly_warmup(total_steps, warmup_steps, power=0.5):
    def fn(step):
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return max(0.0, 1.0 - progress) ** power
    return fn


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for x, labels in loader:
        x, labels = x.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1),
                               ignore_index=-100, reduction="sum")
        stats[0] += loss
        stats[1] += (labels != -100).sum()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(1234)

    train_set = MaskedBlocks(args.train_data, args.seq_len, args.vocab_size, args.mask_id)
    val_set = MaskedBlocks(args.val_data, args.seq_len, args.vocab_size, args.mask_id)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=2, pin_memory=True)

    model = Encoder(args.vocab_size, args.d_model, args.layers, args.heads, args.seq_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = Lamb(model.param_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.999), eps=1e-6)

    total_steps = args.epochs * len(train_loader)
    scheduler = LambdaLR(optimizer, poly_warmup(total_steps, int(args.warmup_frac * total_steps)))

    start_epoch, step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    logger.info("world=%d global batch=%d steps=%d", world, args.batch_size * world, total_steps)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, labels in train_loader:
            x, labels = x.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % args.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                dt = (time.time() - t0) / args.log_every
                logger.info("ep %d step %d loss %.4f gnorm %.3f lr %.2e %.3fs/it",
                            epoch, step, l.item(), gnorm.item(), scheduler.get_last_lr()[0], dt)
                t0 = time.time()

        val_loss = evaluate(model, val_loader, device)
        logger.info("epoch %d val loss %.4f ppl %.2f", epoch, val_loss, math.exp(val_loss))
        if rank == 0:
            torch.save({
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "step": step,
            }, os.path.join(args.out, f"ckpt_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
