"""
Pretraining with a deterministic validation pass: the validation bin is cut into
non-overlapping windows that are split across ranks, so every eval sees the same
tokens and the numbers are comparable between runs. Best checkpoint is kept by val loss.

    torchrun --standalone --nproc_per_node=8 14_gpt_base_fineweb.py --config configs/gpt_base.json
"""
import os
import json
import math
import time
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

DEFAULT_CFG = {
    "data_dir": "data/fineweb",
    "out_dir": "out/gpt-base",
    "block_size": 1024,
    "n_layer": 12,
    "n_head": 12,
    "n_embd": 768,
    "vocab_size": 50304,
    "batch_size": 16,
    "grad_accum_total": 32,
    "lr": 6e-4,
    "min_lr": 6e-5,
    "warmup_iters": 1000,
    "max_iters": 30000,
    "eval_interval": 500,
    "eval_batches": 40,
    "log_interval": 10,
}


class Block(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh = nh
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).view(B, T, 3, self.nh, C // self.nh).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(a.transpose(1, 2).reshape(B, T, C))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["n_embd"]
        self.tok = nn.Embedding(cfg["vocab_size"], d)
        self.pos = nn.Embedding(cfg["block_size"], d)
        self.blocks = nn.ModuleList(Block(d, cfg["n_head"]) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg["vocab_size"], bias=False)
        self.tok.weight = self.head.weight
        self.apply(lambda m: nn.init.normal_(m.weight, std=0.02) if isinstance(m, (nn.Linear, nn.Embedding)) else None)

    def forward(self, idx, targets, reduction="mean"):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction=reduction)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(json.load(f))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    master = rank == 0
    assert cfg["grad_accum_total"] % world == 0
    accum = cfg["grad_accum_total"] // world
    B, T = cfg["batch_size"], cfg["block_size"]
    tokens_per_iter = B * T * accum * world

    train_data = np.memmap(os.path.join(cfg["data_dir"], "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(cfg["data_dir"], "val.bin"), dtype=np.uint16, mode="r")
    n_val_windows = (len(val_data) - 1) // T
    my_val_windows = np.arange(rank, n_val_windows, world)[: cfg["eval_batches"] * B]

    gen = torch.Generator().manual_seed(2024 + rank)

    def train_batch():
        ix = torch.randint(len(train_data) - T - 1, (B,), generator=gen).tolist()
        xy = torch.from_numpy(np.stack([train_data[i:i + T + 1] for i in ix]).astype(np.int64))
        xy = xy.pin_memory().to(device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    torch.manual_seed(2024)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    raw_model = model
    model = DDP(torch.compile(model), device_ids=[local_rank])

    @torch.no_grad()
    def evaluate():
        model.eval()
        loss_sum, n_tok = 0.0, 0
        for j in range(0, len(my_val_windows), B):
            w = my_val_windows[j:j + B]
            xy = np.stack([val_data[s * T:s * T + T + 1] for s in w]).astype(np.int64)
            xy = torch.from_numpy(xy).to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_sum += model(xy[:, :-1], xy[:, 1:], reduction="sum").item()
            n_tok += xy[:, 1:].numel()
        model.train()
        return loss_sum / n_tok

    def lr_at(it):
        if it < cfg["warmup_iters"]:
            return cfg["lr"] * (it + 1) / cfg["warmup_iters"]
        r = min(1.0, (it - cfg["warmup_iters"]) / (cfg["max_iters"] - cfg["warmup_iters"]))
        return cfg["min_lr"] + 0.5 * (1 + math.cos(math.pi * r)) * (cfg["lr"] - cfg["min_lr"])

    if master:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"params {n_params/1e6:.1f}M | accum {accum} | tokens/iter {tokens_per_iter:,} | "
              f"val windows/rank {len(my_val_windows)}")
    best_val = float("inf")
    t0 = time.time()
    for it in range(cfg["max_iters"] + 1):
        if it % cfg["eval_interval"] == 0:
            val_loss = evaluate()
            if master:
                print(f"it {it} val_loss {val_loss:.4f} val_ppl {math.exp(val_loss):.2f}")
                with open(os.path.join(cfg["out_dir"], "val.jsonl"), "a") as f:
                    f.write(json.dumps({"it": it, "val_loss": val_loss}) + "\n")
                if it > 0 and val_loss < best_val:
                    best_val = val_loss
                    torch.save({"model": raw_model.state_dict(), "it": it, "val_loss": val_loss, "cfg": cfg},
                               os.path.join(cfg["out_dir"], "best.pt"))
        if it == cfg["max_iters"]:
            break

        lr = lr_at(it)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_acc = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = train_batch()
            model.require_backward_grad_sync = micro == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / accum
            loss.backward()
            loss_acc += loss.detach()
        gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if it % cfg["log_interval"] == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            dt = (time.time() - t0) / (cfg["log_interval"] if it else 1)
            t0 = time.time()
            if master:
                tps = tokens_per_iter / dt
                mfu = 6 * n_params * tps / (world * 989e12)
                print(f"it {it} loss {loss_acc.item():.4f} lr {lr:.2e} gnorm {gn.item():.2f} "
                      f"{dt*1000:.0f}ms {tps:,.0f} tok/s mfu {mfu*100:.1f}%")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
