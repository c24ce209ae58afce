# Small GPT pretraining on a memory-mapped token bin, random windows per rank.
#
#   torchrun --standalone --nproc_per_node=4 02_nano_random_windows.py
#   torchrun --standalone --nproc_per_node=4 02_nano_random_windows.py --resume
import os
import sys
import math
import time
import json
import argparse
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class ModelConfig:
    vocab_size: int = 50304
    block_size: int = 512
    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 512


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate='tanh'))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument('--data_dir', default='data/fineweb10B')
    p.add_argument('--out_dir', default='runs/nano-512')
    p.add_argument('--batch_size', type=int, default=32)
    p.add_argument('--total_batch_tokens', type=int, default=524288)
    p.add_argument('--max_lr', type=float, default=1e-3)
    p.add_argument('--min_lr', type=float, default=1e-4)
    p.add_argument('--warmup_iters', type=int, default=700)
    p.add_argument('--max_iters', type=int, default=19000)
    p.add_argument('--eval_every', type=int, default=250)
    p.add_argument('--eval_batches', type=int, default=50)
    p.add_argument('--save_every', type=int, default=1000)
    p.add_argument('--seed', type=int, default=1337)
    p.add_argument('--wandb', action='store_true')
    p.add_argument('--resume', action='store_true')
    return p.parse_args()


def lr_at(it, a):
    if it < a.warmup_iters:
        return a.max_lr * (it + 1) / a.warmup_iters
    ratio = min(1.0, (it - a.warmup_iters) / max(1, a.max_iters - a.warmup_iters))
    return a.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (a.max_lr - a.min_lr)


class RandomWindows:
    """Samples random contiguous windows from a uint16 token file."""

    def __init__(self, path, batch_size, block_size, device, seed):
        self.data = np.memmap(path, dtype=np.uint16, mode='r')
        self.B, self.T = batch_size, block_size
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        ix = torch.randint(len(self.data) - self.T - 1, (self.B,), generator=self.gen)
        buf = np.stack([self.data[i:i + self.T + 1] for i in ix.tolist()]).astype(np.int64)
        buf = torch.from_numpy(buf).pin_memory().to(self.device, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]


def main():
    args = parse_args()
    rank = int(os.environ['RANK'])
    local_rank = int(os.environ['LOCAL_RANK'])
    world_size = int(os.environ['WORLD_SIZE'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl', device_id=torch.device('cuda', local_rank))
    device = torch.device('cuda', local_rank)
    is_master = rank == 0

    cfg = ModelConfig()
    tokens_per_micro = args.batch_size * cfg.block_size * world_size
    assert args.total_batch_tokens % tokens_per_micro == 0
    grad_accum = args.total_batch_tokens // tokens_per_micro

    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.max_lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    step = 0
    ckpt_path = os.path.join(args.out_dir, 'last.pt')
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        step = ckpt['step']
        del ckpt

    # each rank draws its own windows; include the step so a resumed run does not replay
    train = RandomWindows(os.path.join(args.data_dir, 'train.bin'), args.batch_size, cfg.block_size,
                          device, seed=args.seed + 1000 * rank + step)
    val_seed = args.seed + 7 + rank

    model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    run = None
    if is_master:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, 'config.json'), 'w') as f:
            json.dump({'args': vars(args), 'model': asdict(cfg), 'world_size': world_size}, f, indent=2)
        if args.wandb:
            import wandb
            run = wandb.init(project='nano-pretrain', config=vars(args), resume='allow')
        print(f"grad_accum={grad_accum} tokens/step={args.total_batch_tokens:,}")

    @torch.no_grad()
    def evaluate():
        model.eval()
        # same windows every eval on a given rank, different windows across ranks
        val = RandomWindows(os.path.join(args.data_dir, 'val.bin'), args.batch_size, cfg.block_size,
                            device, seed=val_seed)
        tot = torch.zeros(1, device=device)
        for _ in range(args.eval_batches):
            x, y = val.next()
            with torch.autocast('cuda', dtype=torch.bfloat16):
                tot += model(x, y)
        tot /= args.eval_batches
        dist.all_reduce(tot, op=dist.ReduceOp.AVG)
        model.train()
        return tot.item()

    n_params = sum(p.numel() for p in model.parameters())
    flops_per_step = 6 * n_params * args.total_batch_tokens
    x, y = train.next()
    t_last = time.perf_counter()
    while step < args.max_iters:
        if step % args.eval_every == 0:
            vl = evaluate()
            if is_master:
                print(f"step {step} val_loss {vl:.4f}")
                if run:
                    run.log({'val/loss': vl}, step=step)

        lr = lr_at(step, args)
        for g in optimizer.param_groups:
            g['lr'] = lr

        loss_acc = torch.zeros((), device=device)
        for micro in range(grad_accum):
            model.require_backward_grad_sync = micro == grad_accum - 1
            with torch.autocast('cuda', dtype=torch.bfloat16):
                loss = model(x, y) / grad_accum
            x, y = train.next()
            loss.backward()
            loss_acc += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            now = time.perf_counter()
            dt = (now - t_last) / 10
            t_last = now
            if is_master:
                tok_s = args.total_batch_tokens / dt
                mfu = flops_per_step / dt / (world_size * 989e12)
                print(f"step {step} loss {loss_acc.item():.4f} lr {lr:.2e} norm {norm.item():.2f} "
                      f"dt {dt*1000:.0f}ms tok/s {tok_s:,.0f} mfu {mfu*100:.1f}%")
                if run:
                    run.log({'train/loss': loss_acc.item(), 'lr': lr, 'tok_s': tok_s, 'mfu': mfu}, step=step)

        if step % args.save_every == 0 or step == args.max_iters:
            if is_master:
                state = {'model': model.module._orig_mod.state_dict(),
                         'optimizer': optimizer.state_dict(),
                         'step': step, 'args': vars(args)}
                torch.save(state, ckpt_path + '.tmp')
                os.replace(ckpt_path + '.tmp', ckpt_path)
            dist.barrier()

    if run:
        run.finish()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
    sys.exit(0)
