"""
GPT-2 (124M) pretraining on OpenWebText token bins.

single node:  torchrun --standalone --nproc_per_node=8 01_gpt2_owt.py
resume:       torchrun --standalone --nproc_per_node=8 01_gpt2_owt.py --init_from=resume
"""
import os
import math
import time
import argparse
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


# ----------------------------------------------------------------------------- model

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head = n_head
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=False),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=False),
            nn.Dropout(dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('mlp.2.weight') or pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# ----------------------------------------------------------------------------- config

parser = argparse.ArgumentParser()
parser.add_argument('--out_dir', type=str, default='out-owt')
parser.add_argument('--data_dir', type=str, default='data/openwebtext')
parser.add_argument('--init_from', type=str, default='scratch', choices=['scratch', 'resume'])
parser.add_argument('--batch_size', type=int, default=12)
parser.add_argument('--block_size', type=int, default=1024)
parser.add_argument('--grad_accum', type=int, default=40)
parser.add_argument('--n_layer', type=int, default=12)
parser.add_argument('--n_head', type=int, default=12)
parser.add_argument('--n_embd', type=int, default=768)
parser.add_argument('--learning_rate', type=float, default=6e-4)
parser.add_argument('--min_lr', type=float, default=6e-5)
parser.add_argument('--warmup_iters', type=int, default=2000)
parser.add_argument('--lr_decay_iters', type=int, default=600000)
parser.add_argument('--max_iters', type=int, default=600000)
parser.add_argument('--weight_decay', type=float, default=0.1)
parser.add_argument('--grad_clip', type=float, default=1.0)
parser.add_argument('--eval_interval', type=int, default=2000)
parser.add_argument('--eval_iters', type=int, default=200)
parser.add_argument('--log_interval', type=int, default=10)
parser.add_argument('--compile', action='store_true')
args = parser.parse_args()

ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    dist.init_process_group(backend='nccl')
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    device = f'cuda:{ddp_local_rank}'
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert args.grad_accum % ddp_world_size == 0
    args.grad_accum //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
    device = 'cuda'

tokens_per_iter = args.grad_accum * ddp_world_size * args.batch_size * args.block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(args.out_dir, exist_ok=True)

torch.manual_seed(1337 + seed_offset)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ctx = torch.autocast(device_type='cuda', dtype=torch.bfloat16)


def get_batch(split):
    # recreate the memmap every batch to avoid a memory leak
    fname = 'train.bin' if split == 'train' else 'val.bin'
    data = np.memmap(os.path.join(args.data_dir, fname), dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


iter_num = 0
best_val_loss = 1e9
model_args = dict(vocab_size=50304, block_size=args.block_size, n_layer=args.n_layer,
                  n_head=args.n_head, n_embd=args.n_embd, dropout=0.0)

if args.init_from == 'scratch':
    model = GPT(**model_args)
    checkpoint = None
else:
    ckpt_path = os.path.join(args.out_dir, 'ckpt.pt')
    checkpoint = torch.load(ckpt_path)
    for k in ['n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size']:
        model_args[k] = checkpoint['model_args'][k]
    model = GPT(**model_args)
    state_dict = checkpoint['model']
    unwanted_prefix = '_orig_mod.'
    for k in list(state_dict.keys()):
        if k.startswith(unwanted_prefix):
            state_dict[k[len(unwanted_prefix):]] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    iter_num = checkpoint['iter_num']
    best_val_loss = checkpoint['best_val_loss']
model.to(device)

decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{'params': decay, 'weight_decay': args.weight_decay}, {'params': no_decay, 'weight_decay': 0.0}],
    lr=args.learning_rate, betas=(0.9, 0.95), fused=True,
)
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint['optimizer'])
checkpoint = None

raw_model = model
if args.compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(args.eval_iters, device=device)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        mean = losses.mean()
        if ddp:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        out[split] = mean.item()
    model.train()
    return out


def get_lr(it):
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)


def flops_per_token(cfg):
    N = sum(p.numel() for p in raw_model.parameters())
    L, H, Q, T = cfg['n_layer'], cfg['n_head'], cfg['n_embd'] // cfg['n_head'], cfg['block_size']
    return 6 * N + 12 * L * H * Q * T


X, Y = get_batch('train')
t0 = time.time()
local_iter_num = 0
running_mfu = -1.0
fpt = flops_per_token(model_args)

while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    if iter_num % args.eval_interval == 0:
        losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses['val'] < best_val_loss or iter_num > 0:
                best_val_loss = min(best_val_loss, losses['val'])
                ckpt = {
                    'model': raw_model.state_dict(),
                    'optimizer': optimizer.state_dict(),
                    'model_args': model_args,
                    'iter_num': iter_num,
                    'best_val_loss': best_val_loss,
                    'args': vars(args),
                }
                print(f"saving checkpoint to {args.out_dir}")
                torch.save(ckpt, os.path.join(args.out_dir, 'ckpt.pt'))

    for micro_step in range(args.grad_accum):
        if ddp:
            model.require_backward_grad_sync = (micro_step == args.grad_accum - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / args.grad_accum
        X, Y = get_batch('train')
        loss.backward()
    if args.grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % args.log_interval == 0 and master_process:
        lossf = loss.item() * args.grad_accum
        if local_iter_num >= 5:
            flops_achieved = fpt * tokens_per_iter / ddp_world_size / dt
            mfu = flops_achieved / 989e12  # H100 bf16 dense peak
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, "
              f"tok/s {tokens_per_iter / dt:,.0f}, mfu {running_mfu*100:.2f}%")
    iter_num += 1
    local_iter_num += 1

    if iter_num > args.max_iters:
        break

if ddp:
    dist.destroy_process_group()
