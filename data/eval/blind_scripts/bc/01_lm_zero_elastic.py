#!/usr/bin/env python
"""GPT-style pretraining on pre-tokenized shards.

Launched with elastic torchrun so that a lost node does not kill the job:
the agent restarts the workers and they pick up from the last checkpoint.
Optimizer state is sharded across ranks with ZeroRedundancyOptimizer.
"""
import argparse
import glob
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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("pretrain")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=16, help="per-GPU micro batch")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-batches", type=int, default=50)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class TokenShards(Dataset):
    """Memory-mapped uint16 token shards cut into fixed-length windows."""

    def __init__(self, pattern, seq_len):
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise FileNotFoundError(pattern)
        self.seq_len = seq_len
        self.arrays = [np.memmap(f, dtype=np.uint16, mode="r") for f in self.files]
        self.index = []
        for i, arr in enumerate(self.arrays):
            n = (len(arr) - 1) // seq_len
            self.index.extend((i, j * seq_len) for j in range(n))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, idx):
        f, off = self.index[idx]
        window = self.arrays[f][off: off + self.seq_len + 1].astype(np.int64)
        chunk = torch.from_numpy(window)
        return chunk[:-1], chunk[1:]


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x):
        t = x.size(1)
        pos = torch.arange(t, device=x.device)
        h = self.tok(x) + self.pos(pos)
        h = self.blocks(h, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.ln(h))


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def cosine_with_warmup(warmup, total, lr, min_lr):
    def fn(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return (min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))) / lr
    return fn


def save_checkpoint(run_dir, model, optimizer, scheduler, epoch, step, rank):
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    # Each rank owns one partition of the Adam state. Consolidating it on rank 0
    # costs a full gather every save, so every rank writes its own partition.
    torch.save(optimizer.optim.state_dict(), os.path.join(ckpt_dir, f"optim-rank{rank}.pt"))
    if rank == 0:
        state = {
            "model": model.module.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "step": step,
        }
        tmp = os.path.join(ckpt_dir, "model.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(ckpt_dir, "model.pt"))
    dist.barrier()


def load_checkpoint(run_dir, model, optimizer, scheduler, rank, device):
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    path = os.path.join(ckpt_dir, "model.pt")
    if not os.path.exists(path):
        return 0, 0
    state = torch.load(path, map_location=device)
    model.module.load_state_dict(state["model"])
    scheduler.load_state_dict(state["scheduler"])
    shard = torch.load(os.path.join(ckpt_dir, f"optim-rank{rank}.pt"), map_location=device)
    optimizer.optim.load_state_dict(shard)
    return state["epoch"], state["step"]


@torch.no_grad()
def evaluate(model, loader, device, max_batches):
    model.eval()
    totals = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        totals[0] += loss
        totals[1] += y.numel()
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

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    logger.info("world=%d restart=%d", world, restart)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    train_ds = TokenShards(os.path.join(args.data_dir, "train_*.bin"), args.seq_len)
    val_ds = TokenShards(os.path.join(args.data_dir, "val_*.bin"), args.seq_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=2, pin_memory=True)

    model = GPT(args.vocab_size, args.d_model, args.n_layers, args.n_heads, args.seq_len).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    optimizer = ZeroRedundancyOptimizer(
        param_groups(model.module, args.weight_decay),
        optimizer_class=torch.optim.AdamW,
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(args.warmup_steps, total_steps, args.lr, args.min_lr)
    )

    start_epoch, step = load_checkpoint(args.run_dir, model, optimizer, scheduler, rank, device)
    if start_epoch:
        logger.info("resumed at epoch %d step %d", start_epoch, step)

    metrics_path = os.path.join(args.run_dir, "metrics.jsonl")
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % args.log_every == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                dt = (time.time() - t0) / args.log_every
                tok_s = args.batch_size * args.seq_len * world / dt
                logger.info("epoch %d step %d loss %.4f lr %.2e tok/s %.0f",
                            epoch, step, reduced.item(), scheduler.get_last_lr()[0], tok_s)
                t0 = time.time()

            if step % args.eval_every == 0:
                val_loss = evaluate(model, val_loader, device, args.eval_batches)
                if rank == 0:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps({"step": step, "val_loss": val_loss,
                                            "ppl": math.exp(val_loss)}) + "\n")
                logger.info("step %d val_loss %.4f", step, val_loss)

        save_checkpoint(args.run_dir, model, optimizer, scheduler, epoch + 1, step, rank)
        logger.info("saved checkpoint after epoch %d", epoch)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
