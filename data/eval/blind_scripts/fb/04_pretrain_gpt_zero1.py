"""Small GPT pretraining on packed token shards, DeepSpeed ZeRO-1, fp16.

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
    pretrain_gpt_zero1.py --deepspeed_config configs/zero1_fp16.json --data /fsx/tokens/web_v2
"""
import argparse
import glob
import math
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, ctx, d=1024, n_layer=24, n_head=16, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("causal", torch.triu(torch.full((ctx, ctx), float("-inf")), diagonal=1), persistent=False)
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
        x = self.tok(idx) + self.pos(pos)
        mask = self.causal[:T, :T].to(x.dtype)
        for blk in self.blocks:
            x = blk(x, mask)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class PackedTokens(Dataset):
    """uint16 memmap shards, each sample is ctx+1 contiguous tokens."""

    def __init__(self, pattern, ctx):
        self.shards = [np.memmap(p, dtype=np.uint16, mode="r") for p in sorted(glob.glob(pattern))]
        self.ctx = ctx
        self.index = []
        for si, s in enumerate(self.shards):
            n = (len(s) - 1) // ctx
            self.index.extend((si, j * ctx) for j in range(n))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        si, off = self.index[i]
        chunk = torch.from_numpy(self.shards[si][off: off + self.ctx + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--max_steps", type=int, default=100_000)
    p.add_argument("--eval_interval", type=int, default=1000)
    p.add_argument("--eval_iters", type=int, default=50)
    p.add_argument("--ckpt_dir", default="/fsx/ckpt/gpt350m")
    p.add_argument("--run_name", default="gpt350m-web-v2")
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


@torch.no_grad()
def estimate_val_loss(engine, loader, iters):
    engine.eval()
    losses = torch.zeros(iters, device=engine.device)
    it = iter(loader)
    for k in range(iters):
        x, y = next(it)
        losses[k] = engine(x.to(engine.device), y.to(engine.device))
    engine.train()
    val = losses.mean()
    dist.all_reduce(val, op=dist.ReduceOp.AVG)
    return val.item()


def main():
    args = parse()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()

    wandb.init(project="pretrain", name=args.run_name, config=vars(args))

    train = PackedTokens(os.path.join(args.data, "train_*.bin"), args.ctx)
    val = PackedTokens(os.path.join(args.data, "val_*.bin"), args.ctx)

    model = GPT(args.vocab, args.ctx)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"model params: {n_params / 1e6:.1f}M, train samples {len(train)}")

    engine, _, _, sched = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    mbs = engine.train_micro_batch_size_per_gpu()

    tr_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    va_sampler = DistributedSampler(val, num_replicas=world, rank=rank, shuffle=True, seed=0)
    tr_loader = DataLoader(train, batch_size=mbs, sampler=tr_sampler, num_workers=6, pin_memory=True, drop_last=True)
    va_loader = DataLoader(val, batch_size=mbs, sampler=va_sampler, num_workers=2, drop_last=True)

    if os.path.isfile(os.path.join(args.ckpt_dir, "latest")):
        engine.load_checkpoint(args.ckpt_dir)

    epoch = engine.global_samples // len(train)
    tr_sampler.set_epoch(epoch)
    it = iter(tr_loader)
    t_last = time.time()
    tokens_per_step = engine.train_batch_size() * args.ctx

    while engine.global_steps < args.max_steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            tr_sampler.set_epoch(epoch)
            it = iter(tr_loader)
            x, y = next(it)

        loss = engine(x.to(engine.device, non_blocking=True), y.to(engine.device, non_blocking=True))
        engine.backward(loss)
        engine.step()

        if not engine.is_gradient_accumulation_boundary():
            continue
        step = engine.global_steps
        if step % 20 == 0:
            dt = time.time() - t_last
            t_last = time.time()
            wandb.log({
                "loss": loss.item(),
                "lr": engine.get_lr()[0],
                "tok_per_s": 20 * tokens_per_step / dt,
                "loss_scale": engine.optimizer.cur_scale if hasattr(engine.optimizer, "cur_scale") else 1.0,
            }, step=step)

        if step % args.eval_interval == 0:
            vl = estimate_val_loss(engine, va_loader, args.eval_iters)
            wandb.log({"val_loss": vl, "val_ppl": math.exp(vl)}, step=step)
            engine.save_checkpoint(args.ckpt_dir, tag=f"step{step}")

    engine.save_checkpoint(args.ckpt_dir, tag=f"step{engine.global_steps}")
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
