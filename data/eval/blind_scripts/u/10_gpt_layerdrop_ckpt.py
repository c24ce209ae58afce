"""
Small GPT language model on OpenWebText-style token shards (uint16 .bin files),
plain PyTorch + DDP. Activation checkpointing lets us run 1024-token context with
bigger per-GPU batches; LayerDrop regularises the deeper configs.

    torchrun --standalone --nproc_per_node=8 10_gpt_layerdrop_ckpt.py --n_layer 24 --grad_ckpt --layerdrop 0.1
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
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head, drop):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.n_head, self.drop = n_head, drop

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.drop if self.training else 0.)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d, n_head, drop):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, drop)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(drop))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_head, d, drop=0.0, layerdrop=0.0, grad_ckpt=False):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.drop = nn.Dropout(drop)
        self.blocks = nn.ModuleList([Block(d, n_head, drop) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.layerdrop, self.grad_ckpt = layerdrop, grad_ckpt
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            if self.training and self.layerdrop > 0 and torch.rand(()) < self.layerdrop:
                continue
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x)
            else:
                x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class TokenShards:
    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode='r')
        self.block_size = block_size

    def batch(self, bs, device, gen):
        ix = torch.randint(len(self.data) - self.block_size - 1, (bs,), generator=gen)
        x = torch.stack([torch.from_numpy(self.data[i:i + self.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(self.data[i + 1:i + 1 + self.block_size].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def get_lr(it, args):
    if it < args.warmup:
        return args.lr * (it + 1) / args.warmup
    ratio = (it - args.warmup) / max(1, args.max_iters - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(ratio, 1.0)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--data_dir', default='data/openwebtext')
    ap.add_argument('--out_dir', default='out/gpt_ld')
    ap.add_argument('--n_layer', type=int, default=12)
    ap.add_argument('--n_head', type=int, default=12)
    ap.add_argument('--d_model', type=int, default=768)
    ap.add_argument('--block_size', type=int, default=1024)
    ap.add_argument('--vocab', type=int, default=50304)
    ap.add_argument('--dropout', type=float, default=0.0)
    ap.add_argument('--layerdrop', type=float, default=0.0)
    ap.add_argument('--grad_ckpt', action='store_true')
    ap.add_argument('--global_batch', type=int, default=480, help='sequences per optimizer step, all GPUs')
    ap.add_argument('--micro_batch', type=int, default=12)
    ap.add_argument('--lr', type=float, default=6e-4)
    ap.add_argument('--min_lr', type=float, default=6e-5)
    ap.add_argument('--warmup', type=int, default=2000)
    ap.add_argument('--max_iters', type=int, default=100000)
    ap.add_argument('--eval_interval', type=int, default=1000)
    ap.add_argument('--eval_iters', type=int, default=100)
    ap.add_argument('--seed', type=int, default=1337)
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f'cuda:{local_rank}'
    master = rank == 0
    assert args.global_batch % (args.micro_batch * world) == 0
    accum = args.global_batch // (args.micro_batch * world)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + rank)
    train_data = TokenShards(os.path.join(args.data_dir, 'train.bin'), args.block_size)
    val_data = TokenShards(os.path.join(args.data_dir, 'val.bin'), args.block_size)

    model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, args.d_model, args.dropout,
                args.layerdrop, args.grad_ckpt).to(device)
    # layers skipped by LayerDrop get no gradient in that step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=args.layerdrop > 0)
    raw = model.module

    decay = [p for n, p in raw.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in raw.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': no_decay, 'weight_decay': 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)
    amp = torch.autocast('cuda', dtype=torch.bfloat16)

    it = 0
    ckpt_path = os.path.join(args.out_dir, 'ckpt.pt')
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        raw.load_state_dict(ck['model'])
        opt.load_state_dict(ck['opt'])
        it = ck['iter']
    writer = None
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out_dir, 'tb'))
        print(f'world {world}, grad accum {accum}, tokens/step {args.global_batch * args.block_size}')

    @torch.no_grad()
    def estimate_loss():
        raw.eval()
        eval_gen = torch.Generator().manual_seed(1234 + rank)
        out = {}
        for name, ds in (('train', train_data), ('val', val_data)):
            losses = torch.zeros(args.eval_iters, device=device)
            for k in range(args.eval_iters):
                x, y = ds.batch(args.micro_batch, device, eval_gen)
                with amp:
                    _, l = raw(x, y)
                losses[k] = l
            m = losses.mean()
            dist.all_reduce(m)
            out[name] = (m / world).item()
        raw.train()
        return out

    x, y = train_data.batch(args.micro_batch, device, gen)
    t0 = time.time()
    while it < args.max_iters:
        lr = get_lr(it, args)
        for g in opt.param_groups:
            g['lr'] = lr
        if it % args.eval_interval == 0 and it > 0:
            losses = estimate_loss()
            if master:
                print(f'iter {it}: train {losses["train"]:.4f} val {losses["val"]:.4f}')
                writer.add_scalar('loss/val', losses['val'], it)
                torch.save({'model': raw.state_dict(), 'opt': opt.state_dict(), 'iter': it, 'args': vars(args)},
                           ckpt_path + '.tmp')
                os.replace(ckpt_path + '.tmp', ckpt_path)
        for micro in range(accum):
            ctx = model.no_sync() if micro < accum - 1 else nullcontext()
            with ctx:
                with amp:
                    _, loss = model(x, y)
                    loss = loss / accum
                x, y = train_data.batch(args.micro_batch, device, gen)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
        if master and it % 10 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f'iter {it} loss {loss.item() * accum:.4f} lr {lr:.2e} {dt * 100:.0f}ms/it')
            writer.add_scalar('loss/train', loss.item() * accum, it)

    if master:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
