#!/usr/bin/env python
"""Sparse MoE GPT pre-training with DeepSpeed expert parallelism.

Every other FFN is replaced by a top-k gated MoE layer. Experts are sharded
over `--ep-size` ranks; the remaining dense weights are data parallel under
ZeRO-2 (config in configs/moe_zero2.json).

    deepspeed --num_gpus 8 01_moe_gpt_pretrain.py \
        --deepspeed_config configs/moe_zero2.json \
        --data-path /data/owt/train.npy --val-path /data/owt/val.npy \
        --num-experts 16 --ep-size 8
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import wandb


def get_args():
    p = argparse.ArgumentParser(description="MoE GPT pre-training")
    p.add_argument("--data-path", type=str, required=True)
    p.add_argument("--val-path", type=str, required=True)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--moe-every", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=20)
    p.add_argument("--eval-interval", type=int, default=500)
    p.add_argument("--eval-iters", type=int, default=50)
    p.add_argument("--save-interval", type=int, default=2000)
    p.add_argument("--save-dir", type=str, default="checkpoints/moe_gpt")
    p.add_argument("--wandb-project", type=str, default="moe-gpt")
    p.add_argument("--run-name", type=str, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


class TokenChunks(Dataset):
    """Fixed-length windows over a flat uint16 token file."""

    def __init__(self, path, seq_len):
        self.tokens = np.load(path, mmap_mode="r")
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[s:s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_heads, dropout):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class FFN(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, args, use_moe):
        super().__init__()
        d = args.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, args.n_heads, args.dropout)
        self.ln2 = nn.LayerNorm(d)
        self.use_moe = use_moe
        if use_moe:
            self.mlp = MoE(hidden_size=d, expert=FFN(d, 4 * d), num_experts=args.num_experts,
                           ep_size=args.ep_size, k=args.top_k,
                           capacity_factor=args.capacity_factor,
                           eval_capacity_factor=args.capacity_factor,
                           min_capacity=4, drop_tokens=True)
        else:
            self.mlp = FFN(d, 4 * d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        if self.use_moe:
            h, l_aux, _ = self.mlp(h)
        else:
            h, l_aux = self.mlp(h), x.new_zeros(())
        return x + h, l_aux


class MoEGPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.d_model)
        self.wpe = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList(
            [Block(args, use_moe=(i % args.moe_every == args.moe_every - 1)) for i in range(args.n_layers)])
        self.ln_f = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        aux = 0.0
        for blk in self.blocks:
            x, l_aux = blk(x)
            aux = aux + l_aux
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return loss, aux


def create_moe_param_groups(model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "ln" in name else decay).append(p)
    groups = [
        {"params": decay, "name": "decay", "weight_decay": 0.1},
        {"params": no_decay, "name": "no_decay", "weight_decay": 0.0},
    ]
    return split_params_into_different_moe_groups_for_optimizer(groups)


@torch.no_grad()
def evaluate(engine, loader, eval_iters):
    engine.eval()
    tot = torch.zeros(2, device=engine.device)
    for i, (x, y) in enumerate(loader):
        if i >= eval_iters:
            break
        loss, _ = engine(x.to(engine.device), y.to(engine.device))
        tot[0] += loss.float()
        tot[1] += 1
    dist.all_reduce(tot)
    engine.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    train_set = TokenChunks(args.data_path, args.seq_len)
    val_set = TokenChunks(args.val_path, args.seq_len)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)

    model = MoEGPT(args)
    engine, _, _, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=create_moe_param_groups(model))

    micro_bs = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    train_loader = DataLoader(train_set, batch_size=micro_bs, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=micro_bs, sampler=val_sampler,
                            num_workers=2, pin_memory=True)

    start_epoch = 0
    if os.path.isdir(args.save_dir) and os.path.exists(os.path.join(args.save_dir, "latest")):
        _, client_state = engine.load_checkpoint(args.save_dir)
        start_epoch = client_state.get("epoch", 0)

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"world={world_size} ep_size={args.ep_size} params/rank={n_params / 1e6:.1f}M "
              f"global_batch={engine.train_batch_size()}")

    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for it, (x, y) in enumerate(train_loader):
            x = x.to(engine.device, non_blocking=True)
            y = y.to(engine.device, non_blocking=True)
            lm_loss, aux = engine(x, y)
            loss = lm_loss + args.aux_loss_coef * aux
            engine.backward(loss)
            engine.step()

            if (it + 1) % gas != 0:
                continue
            step = engine.global_steps
            if step % args.log_interval == 0:
                stats = torch.stack([lm_loss.detach().float(), torch.as_tensor(aux, device=engine.device).float()])
                dist.all_reduce(stats)
                stats /= world_size
                if rank == 0:
                    dt = (time.time() - t0) / args.log_interval
                    t0 = time.time()
                    tok_s = engine.train_batch_size() * args.seq_len / dt
                    print(f"ep {epoch} step {step} loss {stats[0]:.4f} aux {stats[1]:.4f} "
                          f"lr {lr_scheduler.get_last_lr()[0]:.2e} {tok_s:.0f} tok/s")
                    wandb.log({"train/loss": stats[0].item(), "train/aux_loss": stats[1].item(),
                               "train/lr": lr_scheduler.get_last_lr()[0], "perf/tok_s": tok_s}, step=step)

            if step % args.eval_interval == 0:
                val_loss = evaluate(engine, val_loader, args.eval_iters)
                if rank == 0:
                    print(f"step {step} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
                    wandb.log({"val/loss": val_loss, "val/ppl": math.exp(val_loss)}, step=step)

            if step % args.save_interval == 0:
                engine.save_checkpoint(args.save_dir, tag=f"global_step{step}",
                                       client_state={"epoch": epoch})

    engine.save_checkpoint(args.save_dir, tag="final", client_state={"epoch": args.epochs})
    wandb.finish()
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
