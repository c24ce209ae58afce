"""
Pretrain a GPT-2 small sized model on a tokenized corpus (train.bin / val.bin of uint16 tokens).

$ torchrun --standalone --nproc_per_node=8 04_owt_pretrain.py --out_dir out-owt
$ torchrun --standalone --nproc_per_node=8 04_owt_pretrain.py --out_dir out-owt --init_from resume
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument('--out_dir', default='out')
    p.add_argument('--data_dir', default='data/openwebtext')
    p.add_argument('--init_from', default='scratch', choices=['scratch', 'resume'])
    p.add_argument('--eval_interval', type=int, default=1000)
    p.add_argument('--eval_iters', type=int, default=100)
    p.add_argument('--log_interval', type=int, default=10)
    p.add_argument('--batch_size', type=int, default=12)
    p.add_argument('--block_size', type=int, default=1024)
    p.add_argument('--total_batch_tokens', type=int, default=491520)  # ~0.5M tokens per step
    p.add_argument('--n_layer', type=int, default=12)
    p.add_argument('--n_head', type=int, default=12)
    p.add_argument('--n_embd', type=int, default=768)
    p.add_argument('--vocab_size', type=int, default=50304)
    p.add_argument('--lr', type=float, default=6e-4)
    p.add_argument('--min_lr', type=float, default=6e-5)
    p.add_argument('--warmup_iters', type=int, default=2000)
    p.add_argument('--max_iters', type=int, default=600000)
    p.add_argument('--weight_decay', type=float, default=0.1)
    p.add_argument('--grad_clip', type=float, default=1.0)
    p.add_argument('--dtype', default='bfloat16')
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        x = x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate='tanh'))
        return x


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def main():
    args = get_args()

    ddp = int(os.environ.get('RANK', -1)) != -1
    if ddp:
        local_rank = int(os.environ['LOCAL_RANK'])
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend='nccl')
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        device = f'cuda:{local_rank}'
    else:
        rank, world_size, device = 0, 1, 'cuda'
    master = rank == 0

    assert args.total_batch_tokens % (args.batch_size * args.block_size * world_size) == 0
    grad_accum = args.total_batch_tokens // (args.batch_size * args.block_size * world_size)
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world_size={world_size} grad_accum={grad_accum} tokens/step={args.total_batch_tokens}")

    torch.manual_seed(1337 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[args.dtype]
    ctx = torch.autocast(device_type='cuda', dtype=ptdtype)

    train_data = np.memmap(os.path.join(args.data_dir, 'train.bin'), dtype=np.uint16, mode='r')
    val_data = np.memmap(os.path.join(args.data_dir, 'val.bin'), dtype=np.uint16, mode='r')

    def get_batch(split):
        data = train_data if split == 'train' else val_data
        ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model = GPT(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay, fused=True)
    iter_num, best_val = 0, float('inf')
    ckpt_path = os.path.join(args.out_dir, 'ckpt.pt')
    if args.init_from == 'resume':
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        iter_num, best_val = ckpt['iter_num'], ckpt['best_val_loss']
        del ckpt

    if ddp:
        model = DDP(model, device_ids=[local_rank])
    raw_model = model.module if ddp else model

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ('train', 'val'):
            losses = torch.zeros(args.eval_iters, device=device)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    _, loss = model(X, Y)
                losses[k] = loss
            mean = losses.mean()
            if ddp:
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            out[split] = mean.item()
        model.train()
        return out

    def get_lr(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / args.warmup_iters
        if it > args.max_iters:
            return args.min_lr
        ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)

    X, Y = get_batch('train')
    t0 = time.time()
    while iter_num <= args.max_iters:
        lr = get_lr(iter_num)
        for g in optimizer.param_groups:
            g['lr'] = lr

        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()  # every rank takes part in the all_reduce
            if master:
                print(f"step {iter_num}: train {losses['train']:.4f} val {losses['val']:.4f}")
                if losses['val'] < best_val and iter_num > 0:
                    best_val = losses['val']
                    torch.save({'model': raw_model.state_dict(),
                                'optimizer': optimizer.state_dict(),
                                'iter_num': iter_num,
                                'best_val_loss': best_val,
                                'config': vars(args)}, ckpt_path)

        for micro in range(grad_accum):
            if ddp:
                model.require_backward_grad_sync = (micro == grad_accum - 1)
            with ctx:
                _, loss = model(X, Y)
                loss = loss / grad_accum
            X, Y = get_batch('train')
            loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if iter_num % args.log_interval == 0 and master:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {iter_num}: loss {loss.item() * grad_accum:.4f}, lr {lr:.2e}, {dt * 1000:.0f}ms")
        iter_num += 1

    if ddp:
        dist.destroy_process_group()


if __name__ == '__main__':
    main()
