"""Causal LM pretraining on pre-tokenized shards.

Runs as a Kubeflow PyTorchJob (2 worker pods x 4 GPUs). The container command is

    torchrun --nnodes=$PET_NNODES --nproc_per_node=4 --node_rank=$PET_NODE_RANK \
        --master_addr=$PET_MASTER_ADDR --master_port=$PET_MASTER_PORT \
        pretrain.py --data-root /mnt/s3/corpus/tokenized --out /mnt/shared/runs/lm-350m

The corpus bucket is mounted read-only through mountpoint-s3; /mnt/shared is an RWX PVC.
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

logger = logging.getLogger("pretrain")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/mnt/s3/corpus/tokenized")
    p.add_argument("--val-root", default="/mnt/s3/corpus/tokenized-val")
    p.add_argument("--out", default="/mnt/shared/runs/lm")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=24)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class TokenShardStream(IterableDataset):
    """Streams fixed-length windows out of uint16 .npy token shards."""

    def __init__(self, files, seq_len):
        self.files = files
        self.seq_len = seq_len

    def __iter__(self):
        info = get_worker_info()
        files = self.files
        if info is not None:
            files = files[info.id::info.num_workers]
        for path in files:
            tokens = np.load(path, mmap_mode="r")
            n = (len(tokens) - 1) // self.seq_len
            for i in range(n):
                chunk = np.asarray(tokens[i * self.seq_len:(i + 1) * self.seq_len + 1], dtype=np.int64)
                x = torch.from_numpy(chunk[:-1])
                y = torch.from_numpy(chunk[1:])
                yield x, y


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer(
            "mask", torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1), persistent=False
        )

    def forward(self, idx):
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        return self.head(self.ln_f(x))


def lr_at(step, total, warmup, base):
    if step < warmup:
        return base * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 * base + 0.9 * base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model, loader, device, max_batches=200):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        tot[0] += loss
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    torch.manual_seed(args.seed)

    train_files = sorted(glob.glob(os.path.join(args.data_root, "*.npy")))
    val_files = sorted(glob.glob(os.path.join(args.val_root, "*.npy")))
    if rank == 0:
        logger.info("found %d train shards, %d val shards", len(train_files), len(val_files))
        os.makedirs(args.out, exist_ok=True)

    train_ds = TokenShardStream(train_files[rank::world_size], args.seq_len)
    val_ds = TokenShardStream(val_files[rank::world_size], args.seq_len)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=2, pin_memory=True)

    # token counts are written next to the shards by the tokenizer job
    with open(os.path.join(args.data_root, "index.json")) as f:
        total_tokens = json.load(f)["total_tokens"]
    steps_per_epoch = total_tokens // (args.seq_len * args.batch_size * world_size)
    total_steps = steps_per_epoch * args.epochs

    model = TinyGPT(args.vocab_size, args.d_model, args.n_layers, args.n_heads, args.seq_len).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p_ in model.named_parameters():
        (no_decay if p_.ndim < 2 else decay).append(p_)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )

    step = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        logger.info("resumed from step %d", step)

    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total_steps, args.warmup, args.lr)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % args.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                dt = time.time() - t0
                tok_s = args.log_every * args.batch_size * args.seq_len * world_size / dt
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e tok/s %.0f",
                            epoch, step, total_steps, l.item(), opt.param_groups[0]["lr"], tok_s)
                t0 = time.time()

            if step % 2000 == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()

        val_loss = evaluate(model, val_loader, device)
        logger.info("epoch %d val loss %.4f ppl %.2f", epoch, val_loss, math.exp(val_loss))

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "final_model.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
