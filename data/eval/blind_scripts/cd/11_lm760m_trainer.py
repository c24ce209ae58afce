"""
Trainer for a 760M decoder LM with bf16 autocast, compile, and detailed step logging
(loss averaged over ranks, grad norm, tokens/s, MFU).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        11_lm760m_trainer.py --data /lustre/data/redpajama_sample --out /lustre/ckpt/lm760m
"""
import os
import math
import time
import json
import argparse
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class TrainConfig:
    data: str
    out: str
    seq_len: int = 2048
    n_layer: int = 24
    n_head: int = 16
    d_model: int = 1536
    vocab: int = 50304
    micro_bs: int = 4
    global_bs: int = 512
    lr: float = 2.5e-4
    min_lr_ratio: float = 0.1
    warmup: int = 2000
    max_iters: int = 80000
    eval_interval: int = 1000
    eval_iters: int = 40
    log_interval: int = 10
    save_interval: int = 2000
    peak_tflops: float = 989.0


class SwiGLU(nn.Module):
    def __init__(self, d):
        super().__init__()
        h = 256 * ((int(8 * d / 3) + 255) // 256)
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c: TrainConfig):
        super().__init__()
        self.nh = c.n_head
        self.norm1 = nn.RMSNorm(c.d_model)
        self.norm2 = nn.RMSNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.o = nn.Linear(c.d_model, c.d_model, bias=False)
        self.mlp = SwiGLU(c.d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.nh, C // self.nh).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, c: TrainConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Parameter(torch.randn(c.seq_len, c.d_model) * 0.01)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = nn.RMSNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, tgt):
        x = self.embed(idx) + self.pos[: idx.size(1)]
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))


class Trainer:
    def __init__(self, c: TrainConfig):
        self.c = c
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)
        self.master = self.rank == 0
        assert c.global_bs % (c.micro_bs * self.world) == 0
        self.accum = c.global_bs // (c.micro_bs * self.world)
        self.tokens_per_iter = c.global_bs * c.seq_len

        self.train = np.memmap(os.path.join(c.data, "train.bin"), dtype=np.uint16, mode="r")
        self.val = np.memmap(os.path.join(c.data, "val.bin"), dtype=np.uint16, mode="r")
        self.gen = torch.Generator().manual_seed(31337 + self.rank)

        torch.manual_seed(0)
        model = LM(c).to(self.device)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.raw = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        self.iter = 0
        self._maybe_resume()
        self.model = DDP(torch.compile(model), device_ids=[self.local_rank], bucket_cap_mb=100)

    def _maybe_resume(self):
        path = os.path.join(self.c.out, "latest.pt")
        if not os.path.exists(path):
            return
        sd = torch.load(path, map_location=self.device)
        self.raw.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])
        self.iter = sd["iter"]
        self.gen.manual_seed(31337 + self.rank + 7919 * self.iter)

    def batch(self, data, gen):
        T = self.c.seq_len
        ix = torch.randint(len(data) - T - 1, (self.c.micro_bs,), generator=gen)
        xy = torch.from_numpy(np.stack([data[i:i + T + 1] for i in ix.tolist()]).astype(np.int64))
        xy = xy.pin_memory().to(self.device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    def lr(self, it):
        c = self.c
        if it < c.warmup:
            return c.lr * (it + 1) / c.warmup
        r = min(1.0, (it - c.warmup) / (c.max_iters - c.warmup))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * r)))

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        g = torch.Generator().manual_seed(99 + self.rank)
        tot = torch.zeros((), device=self.device)
        for _ in range(self.c.eval_iters):
            x, y = self.batch(self.val, g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                tot += self.model(x, y)
        dist.all_reduce(tot, op=dist.ReduceOp.AVG)
        self.model.train()
        return tot.item() / self.c.eval_iters

    def save(self):
        if self.master:
            os.makedirs(self.c.out, exist_ok=True)
            sd = {"model": self.raw.state_dict(), "opt": self.opt.state_dict(), "iter": self.iter,
                  "config": self.c.__dict__}
            torch.save(sd, os.path.join(self.c.out, "latest.pt.tmp"))
            os.replace(os.path.join(self.c.out, "latest.pt.tmp"), os.path.join(self.c.out, "latest.pt"))
        dist.barrier()

    def step(self):
        lr = self.lr(self.iter)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for m in range(self.accum):
            x, y = self.batch(self.train, self.gen)
            self.model.require_backward_grad_sync = m == self.accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self.model(x, y) / self.accum
            loss.backward()
            loss_sum += loss.detach()
        gnorm = nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.iter += 1
        return loss_sum, gnorm, lr

    def fit(self):
        c = self.c
        t0 = time.time()
        while self.iter < c.max_iters:
            loss_sum, gnorm, lr = self.step()

            if self.master and self.iter % c.log_interval == 0:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
                torch.cuda.synchronize()
                dt = (time.time() - t0) / c.log_interval
                t0 = time.time()
                tok_s = self.tokens_per_iter / dt
                mfu = 6 * self.n_params * tok_s / (self.world * c.peak_tflops * 1e12)
                print(json.dumps({"iter": self.iter, "loss": round(loss_sum.item(), 4), "lr": lr,
                                  "grad_norm": round(gnorm.item(), 3), "tok_s": int(tok_s),
                                  "mfu": round(mfu, 4)}), flush=True)

            if self.iter % c.eval_interval == 0:
                vl = self.evaluate()
                if self.master:
                    print(json.dumps({"iter": self.iter, "val_loss": round(vl, 4)}), flush=True)
            if self.iter % c.save_interval == 0:
                self.save()
        self.save()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_iters", type=int, default=80000)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    a = ap.parse_args()
    Trainer(TrainConfig(data=a.data, out=a.out, max_iters=a.max_iters, micro_bs=a.micro_bs, lr=a.lr)).fit()


if __name__ == "__main__":
    main()
