"""Character/byte-level GPT trained on a pre-tokenized uint16 memmap (train.bin / val.bin).

    torchrun --standalone --nproc_per_node=4 train_gpt.py --data-dir data/shakespeare_char
"""
import argparse
import math
import os
import pickle
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class TrainConfig:
    data_dir: str = "data/shakespeare_char"
    out_dir: str = "out-gpt"
    block_size: int = 256
    micro_batch: int = 64
    grad_accum: int = 8  # across all processes; divided by world size at start
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    max_iters: int = 5000
    eval_interval: int = 250
    eval_iters: int = 100
    seed: int = 1337


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c.n_head
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.dropout = c.dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd), nn.Dropout(c.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.master = self.rank == 0
        assert cfg.grad_accum % self.world == 0
        self.accum = cfg.grad_accum // self.world  # keeps the global batch the same for any world size
        # every process draws its own random batches
        torch.manual_seed(cfg.seed + self.rank)
        self.rng = np.random.default_rng(cfg.seed + self.rank)

        with open(os.path.join(cfg.data_dir, "meta.pkl"), "rb") as f:
            vocab_size = pickle.load(f)["vocab_size"]
        self.data = {s: np.memmap(os.path.join(cfg.data_dir, f"{s}.bin"), dtype=np.uint16, mode="r")
                     for s in ("train", "val")}

        torch.manual_seed(cfg.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
        model = GPT(cfg, vocab_size).to(self.device)
        torch.manual_seed(cfg.seed + self.rank)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.raw = self.model.module
        self.opt = torch.optim.AdamW(self.raw.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.1)
        self.iter = 0
        self.best_val = float("inf")
        ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
        if os.path.exists(ckpt_path):
            ckpt = torch.load(ckpt_path, map_location=self.device)
            self.raw.load_state_dict(ckpt["model"])
            self.opt.load_state_dict(ckpt["optimizer"])
            self.iter, self.best_val = ckpt["iter"], ckpt["best_val"]

    def get_batch(self, split):
        data, bs = self.data[split], self.cfg.block_size
        ix = self.rng.integers(0, len(data) - bs - 1, self.cfg.micro_batch)
        x = torch.from_numpy(np.stack([data[i:i + bs].astype(np.int64) for i in ix]))
        y = torch.from_numpy(np.stack([data[i + 1:i + 1 + bs].astype(np.int64) for i in ix]))
        return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)

    def lr_at(self, it):
        c = self.cfg
        if it < c.warmup_iters:
            return c.lr * (it + 1) / c.warmup_iters
        r = (it - c.warmup_iters) / (c.max_iters - c.warmup_iters)
        return c.min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (c.lr - c.min_lr)

    @torch.no_grad()
    def estimate_loss(self):
        self.model.eval()
        out = {}
        for split in ("train", "val"):
            losses = torch.zeros(self.cfg.eval_iters, device=self.device)
            for k in range(self.cfg.eval_iters):
                x, y = self.get_batch(split)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = self.raw(x, y)
                losses[k] = loss
            mean = losses.mean()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            out[split] = mean.item()
        self.model.train()
        return out

    def save(self):
        os.makedirs(self.cfg.out_dir, exist_ok=True)
        torch.save({"model": self.raw.state_dict(), "optimizer": self.opt.state_dict(), "iter": self.iter,
                    "best_val": self.best_val, "config": asdict(self.cfg)},
                   os.path.join(self.cfg.out_dir, "ckpt.pt"))

    def train(self):
        c = self.cfg
        if self.master:
            tokens = c.micro_batch * c.block_size * self.accum * self.world
            print(f"{sum(p.numel() for p in self.raw.parameters()) / 1e6:.2f}M params, {tokens} tokens/iter")
        x, y = self.get_batch("train")
        t0 = time.time()
        while self.iter < c.max_iters:
            if self.iter % c.eval_interval == 0:
                losses = self.estimate_loss()
                if self.master:
                    print(f"iter {self.iter}: train {losses['train']:.4f} val {losses['val']:.4f}")
                    if losses["val"] < self.best_val:
                        self.best_val = losses["val"]
                        self.save()
                dist.barrier()
            lr = self.lr_at(self.iter)
            for g in self.opt.param_groups:
                g["lr"] = lr
            for micro in range(self.accum):
                last = micro == self.accum - 1
                ctx = self.model.no_sync() if not last else torch.enable_grad()
                with ctx:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        _, loss = self.model(x, y)
                    (loss / self.accum).backward()
                x, y = self.get_batch("train")
            nn.utils.clip_grad_norm_(self.raw.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.iter += 1
            if self.iter % 50 == 0 and self.master:
                print(f"iter {self.iter} loss(rank0 micro-batch) {loss.item():.4f} lr {lr:.2e} "
                      f"{(time.time() - t0) * 20:.0f}ms/iter", flush=True)
                t0 = time.time()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    for k, v in asdict(TrainConfig()).items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    args = p.parse_args()
    Trainer(TrainConfig(**vars(args))).train()


if __name__ == "__main__":
    main()
