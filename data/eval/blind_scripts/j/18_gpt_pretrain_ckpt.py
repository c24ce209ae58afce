"""
GPT pretraining on OpenWebText token shards (nanoGPT-like), activation checkpointing to fit 24 layers.
The same model class is used by our finetuning code, hence the classification head.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
    18_gpt_pretrain_ckpt.py --n_layer 24 --n_embd 1024 --grad_ckpt
"""
import os
import math
import time
import argparse
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument('--data_dir', default='data/openwebtext')
parser.add_argument('--out_dir', default='out-gpt-medium')
parser.add_argument('--n_layer', type=int, default=24)
parser.add_argument('--n_head', type=int, default=16)
parser.add_argument('--n_embd', type=int, default=1024)
parser.add_argument('--block_size', type=int, default=1024)
parser.add_argument('--vocab_size', type=int, default=50304)
parser.add_argument('--num_labels', type=int, default=2)
parser.add_argument('--dropout', type=float, default=0.0)
parser.add_argument('--micro_bs', type=int, default=8)
parser.add_argument('--grad_accum', type=int, default=4)
parser.add_argument('--max_lr', type=float, default=3e-4)
parser.add_argument('--min_lr', type=float, default=3e-5)
parser.add_argument('--warmup_iters', type=int, default=2000)
parser.add_argument('--max_iters', type=int, default=300000)
parser.add_argument('--eval_interval', type=int, default=1000)
parser.add_argument('--eval_iters', type=int, default=100)
parser.add_argument('--grad_ckpt', action='store_true')
parser.add_argument('--seed', type=int, default=1337)
cfg = parser.parse_args()


class Block(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c.n_embd, c.n_head, c.dropout) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.cls_head = nn.Linear(c.n_embd, c.num_labels)  # used by finetune_cls.py
        self.apply(self._init)
        self.register_buffer('mask', torch.triu(torch.full((c.block_size, c.block_size), float('-inf')), 1),
                             persistent=False)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None, use_ckpt=False):
        T = idx.size(1)
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        mask = self.mask[:T, :T]
        for blk in self.blocks:
            if use_ckpt and self.training:
                x = checkpoint(blk, x, mask, use_reentrant=True)
            else:
                x = blk(x, mask)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def get_batch(split, device):
    data = np.memmap(os.path.join(cfg.data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - cfg.block_size, (cfg.micro_bs,))
    x = torch.stack([torch.from_numpy(data[i:i + cfg.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + cfg.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def get_lr(it):
    if it < cfg.warmup_iters:
        return cfg.max_lr * (it + 1) / cfg.warmup_iters
    ratio = min(1.0, (it - cfg.warmup_iters) / (cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (cfg.max_lr - cfg.min_lr)


@torch.no_grad()
def estimate_loss(model, device, ctx):
    model.eval()
    out = {}
    for split in ['train', 'val']:
        losses = torch.zeros(cfg.eval_iters, device=device)
        for k in range(cfg.eval_iters):
            x, y = get_batch(split, device)
            with ctx:
                _, loss = model(x, y)
            losses[k] = loss
        m = losses.mean()
        dist.all_reduce(m, op=dist.ReduceOp.AVG)
        out[split] = m.item()
    model.train()
    return out


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    device = torch.device('cuda', local_rank)
    torch.manual_seed(cfg.seed + rank)  # different data per rank
    torch.backends.cuda.matmul.allow_tf32 = True
    ctx = torch.autocast('cuda', dtype=torch.bfloat16)
    tokens_per_iter = cfg.grad_accum * world * cfg.micro_bs * cfg.block_size
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f'tokens per iteration: {tokens_per_iter:,}')

    torch.manual_seed(cfg.seed)
    model = GPT(cfg).to(device)
    torch.manual_seed(cfg.seed + rank)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    raw = model.module
    decay = [p for n, p in raw.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in raw.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': no_decay, 'weight_decay': 0.0}],
                                  lr=cfg.max_lr, betas=(0.9, 0.95), fused=True)

    best_val = 1e9
    t0 = time.time()
    x, y = get_batch('train', device)
    for it in range(cfg.max_iters + 1):
        lr = get_lr(it)
        for g in optimizer.param_groups:
            g['lr'] = lr
        if it % cfg.eval_interval == 0 and it > 0:
            losses = estimate_loss(model.module, device, ctx)
            if master:
                print(f"step {it}: train {losses['train']:.4f} val {losses['val']:.4f}", flush=True)
                if losses['val'] < best_val:
                    best_val = losses['val']
                    torch.save({'model': raw.state_dict(), 'optimizer': optimizer.state_dict(), 'iter': it,
                                'config': vars(cfg), 'best_val': best_val}, os.path.join(cfg.out_dir, 'ckpt.pt'))
        for micro in range(cfg.grad_accum):
            sync = micro == cfg.grad_accum - 1
            with (nullcontext() if sync else model.no_sync()):
                with ctx:
                    _, loss = model(x, y, use_ckpt=cfg.grad_ckpt)
                    loss = loss / cfg.grad_accum
                x, y = get_batch('train', device)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % 10 == 0 and master:
            dt = time.time() - t0
            t0 = time.time()
            print(f'iter {it}: loss {loss.item() * cfg.grad_accum:.4f}, lr {lr:.2e}, '
                  f'{tokens_per_iter * 10 / dt / 1e3:.1f}k tok/s', flush=True)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
