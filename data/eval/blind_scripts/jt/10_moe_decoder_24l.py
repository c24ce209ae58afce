"""
MoE decoder pretraining with activation checkpointing (fits 24 layers x 16 experts on 40GB cards).

    torchrun --nproc_per_node=8 10_moe_decoder_24l.py --data_root /data/tokenized/en_web --exp moe_24L_16E
"""
import argparse
import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt_utils
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("moe")


@dataclass
class ModelArgs:
    vocab: int = 50304
    ctx: int = 2048
    d_model: int = 1024
    n_heads: int = 16
    n_layers: int = 24
    n_experts: int = 16
    top_k: int = 2
    capacity: float = 1.25
    act_ckpt: bool = True


class ShardedBin(Dataset):
    def __init__(self, root, split, ctx):
        self.file = os.path.join(root, f"{split}.bin")
        self.ctx = ctx
        self.items = (os.path.getsize(self.file) // 2 - 1) // ctx
        self.mm = None

    def __len__(self):
        return self.items

    def __getitem__(self, i):
        if self.mm is None:
            self.mm = np.memmap(self.file, dtype=np.uint16, mode="r")
        arr = self.mm[i * self.ctx: (i + 1) * self.ctx + 1].astype(np.int64)
        return torch.from_numpy(arr[:-1]), torch.from_numpy(arr[1:])


class TopKRouter(nn.Module):
    def __init__(self, d, n_experts, k):
        super().__init__()
        self.proj = nn.Linear(d, n_experts, bias=False)
        self.n_experts, self.k = n_experts, k

    def forward(self, x):
        logits = self.proj(x).float()
        probs = logits.softmax(-1)
        w, idx = probs.topk(self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        f = torch.zeros(self.n_experts, device=x.device).scatter_add_(
            0, idx.flatten(), torch.ones(idx.numel(), device=x.device)) / idx.numel()
        aux = self.n_experts * (f * probs.mean(0)).sum()
        z = logits.logsumexp(-1).pow(2).mean()
        return w, idx, aux + 1e-3 * z


class MoEMLP(nn.Module):
    def __init__(self, d, n_experts, k, capacity):
        super().__init__()
        self.router = TopKRouter(d, n_experts, k)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))
            for _ in range(n_experts))
        self.n_experts, self.k, self.capacity = n_experts, k, capacity

    def forward(self, x):
        n, d = x.shape
        w, idx, aux = self.router(x)
        cap = int(math.ceil(self.capacity * n * self.k / self.n_experts))
        y = torch.zeros_like(x)
        for e in range(self.n_experts):
            tok, kk = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            tok, kk = tok[:cap], kk[:cap]
            y.index_add_(0, tok, (self.experts[e](x[tok]) * w[tok, kk].unsqueeze(1)).to(y.dtype))
        return y, aux


class Layer(nn.Module):
    def __init__(self, m: ModelArgs):
        super().__init__()
        self.n_heads = m.n_heads
        self.ln_attn = nn.LayerNorm(m.d_model)
        self.ln_mlp = nn.LayerNorm(m.d_model)
        self.wqkv = nn.Linear(m.d_model, 3 * m.d_model, bias=False)
        self.wo = nn.Linear(m.d_model, m.d_model, bias=False)
        self.mlp = MoEMLP(m.d_model, m.n_experts, m.top_k, m.capacity)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.wqkv(self.ln_attn(x)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        y, aux = self.mlp(self.ln_mlp(x).view(B * T, D))
        return x + y.view(B, T, D), aux


class MoEDecoder(nn.Module):
    def __init__(self, m: ModelArgs):
        super().__init__()
        self.m = m
        self.embed = nn.Embedding(m.vocab, m.d_model)
        self.pos = nn.Embedding(m.ctx, m.d_model)
        self.layers = nn.ModuleList(Layer(m) for _ in range(m.n_layers))
        self.ln_f = nn.LayerNorm(m.d_model)
        self.lm_head = nn.Linear(m.d_model, m.vocab, bias=False)
        self.embed.weight = self.lm_head.weight

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        aux_total = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            if self.m.act_ckpt and self.training:
                x, aux = ckpt_utils.checkpoint(layer, x, use_reentrant=True)
            else:
                x, aux = layer(x)
            aux_total = aux_total + aux
        return self.lm_head(self.ln_f(x)), aux_total / len(self.layers)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s",
                            level=logging.INFO if self.rank == 0 else logging.WARNING)
        torch.manual_seed(args.seed)

        self.margs = ModelArgs(n_experts=args.experts, act_ckpt=not args.no_act_ckpt)
        model = MoEDecoder(self.margs).to(self.device)
        # experts with no routed tokens in a step have no gradient
        self.model = DDP(model, device_ids=[self.local_rank], find_unused_parameters=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                     weight_decay=0.1, fused=True)

        self.train_ds = ShardedBin(args.data_root, "train", self.margs.ctx)
        self.val_ds = ShardedBin(args.data_root, "val", self.margs.ctx)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, seed=args.seed, drop_last=True)
        self.loader = DataLoader(self.train_ds, batch_size=args.micro_bs, sampler=self.sampler,
                                 num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
        self.val_loader = DataLoader(self.val_ds, batch_size=args.micro_bs,
                                     sampler=DistributedSampler(self.val_ds, shuffle=False, drop_last=True),
                                     num_workers=2)
        self.out_dir = os.path.join(args.out_root, args.exp)
        if self.rank == 0:
            os.makedirs(self.out_dir, exist_ok=True)

    def lr(self, step):
        a = self.args
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = (step - a.warmup) / max(1, a.max_steps - a.warmup)
        return a.lr * max(0.1, 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    def loss_fn(self, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, aux = self.model(x)
        ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        return ce, aux

    @torch.no_grad()
    def validate(self, max_batches=200):
        self.model.eval()
        tot = torch.zeros(2, device=self.device)
        for i, (x, y) in enumerate(self.val_loader):
            if i == max_batches:
                break
            ce, _ = self.loss_fn(x.to(self.device), y.to(self.device))
            tot += torch.stack([ce, torch.ones_like(ce)])
        dist.all_reduce(tot)
        self.model.train()
        return (tot[0] / tot[1]).item()

    def save(self, step):
        if self.rank != 0:
            return
        torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                    "step": step, "model_args": self.margs.__dict__},
                   os.path.join(self.out_dir, f"step{step}.pt"))

    def fit(self):
        a = self.args
        step, epoch = 0, 0
        t0 = time.time()
        while step < a.max_steps:
            self.sampler.set_epoch(epoch)
            for x, y in self.loader:
                for g in self.opt.param_groups:
                    g["lr"] = self.lr(step)
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                ce, aux = self.loss_fn(x, y)
                (ce + a.aux_coef * aux).backward()
                gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.clip)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                step += 1
                if step % a.log_every == 0:
                    s = torch.stack([ce.detach(), aux.detach()])
                    dist.all_reduce(s, op=dist.ReduceOp.AVG)
                    tok_per_s = a.log_every * a.micro_bs * self.margs.ctx * self.world / (time.time() - t0)
                    logger.info("step %d ce %.4f aux %.4f gnorm %.2f lr %.2e tok/s %.0f",
                                step, s[0], s[1], gnorm, self.lr(step), tok_per_s)
                    t0 = time.time()
                if step % a.eval_every == 0:
                    logger.info("step %d val ce %.4f", step, self.validate())
                    self.save(step)
                if step >= a.max_steps:
                    break
            epoch += 1
        self.save(step)
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--out_root", default="/results/moe")
    ap.add_argument("--exp", default="moe_24L_16E")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--no_act_ckpt", action="store_true")
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--max_steps", type=int, default=100000)
    ap.add_argument("--aux_coef", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--log_every", type=int, default=20)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    Trainer(ap.parse_args()).fit()


if __name__ == "__main__":
    main()
