"""Small GPT pre-training on a pre-tokenized uint16 token file.

This started as a Horovod script (hvd.DistributedOptimizer + fp16 compression)
and was moved to torch DDP + torchrun. Config is a YAML file, CLI overrides
use key=value.
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    train_bin="data/train.bin", val_bin="data/val.bin", out_dir="ckpt",
    block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0,
    micro_batch=12, max_steps=60000, warmup_steps=2000, lr=6e-4, min_lr=6e-5,
    weight_decay=0.1, grad_clip=1.0, eval_every=1000, eval_batches=50, save_every=2000,
    keep_last=3, seed=1337,
)


class TokenBlocks(Dataset):
    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block_size
        self.n = (len(self.data) - 1) // block_size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        chunk = torch.from_numpy(self.data[i * self.block:(i + 1) * self.block + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1 = nn.LayerNorm(c["n_embd"])
        self.attn = nn.MultiheadAttention(c["n_embd"], c["n_head"], dropout=c["dropout"], batch_first=True)
        self.ln2 = nn.LayerNorm(c["n_embd"])
        self.mlp = nn.Sequential(nn.Linear(c["n_embd"], 4 * c["n_embd"]), nn.GELU(),
                                 nn.Linear(4 * c["n_embd"], c["n_embd"]), nn.Dropout(c["dropout"]))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.pos = nn.Embedding(c["block_size"], c["n_embd"])
        self.blocks = nn.ModuleList([Block(c) for _ in range(c["n_layer"])])
        self.ln_f = nn.LayerNorm(c["n_embd"])
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.lm_head.weight = self.tok.weight
        mask = torch.triu(torch.ones(c["block_size"], c["block_size"], dtype=torch.bool), 1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx):
        T = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:T, :T])
        return self.lm_head(self.ln_f(x))


def lr_at(step, c):
    if step < c["warmup_steps"]:
        return c["lr"] * (step + 1) / c["warmup_steps"]
    ratio = (step - c["warmup_steps"]) / max(1, c["max_steps"] - c["warmup_steps"])
    return c["min_lr"] + 0.5 * (1 + math.cos(math.pi * min(ratio, 1.0))) * (c["lr"] - c["min_lr"])


def save_checkpoint(model, optimizer, step, cfg):
    os.makedirs(cfg["out_dir"], exist_ok=True)
    path = os.path.join(cfg["out_dir"], f"step_{step:07d}.pt")
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "config": cfg}, path)
    old = sorted(glob.glob(os.path.join(cfg["out_dir"], "step_*.pt")))[:-cfg["keep_last"]]
    for f in old:
        os.remove(f)


def latest_checkpoint(out_dir):
    ckpts = sorted(glob.glob(os.path.join(out_dir, "step_*.pt")))
    return ckpts[-1] if ckpts else None


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= cfg["eval_batches"]:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        total[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        total[1] += y.numel()
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f))
    for kv in a.overrides:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])
    torch.backends.cuda.matmul.allow_tf32 = True

    train_ds = TokenBlocks(cfg["train_bin"], cfg["block_size"])
    val_ds = TokenBlocks(cfg["val_bin"], cfg["block_size"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["micro_batch"], sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["micro_batch"], sampler=val_sampler,
                            num_workers=2, pin_memory=True)

    model = GPT(cfg).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg["lr"], betas=(0.9, 0.95), fused=True)

    step = 0
    ckpt_path = latest_checkpoint(cfg["out_dir"])
    if ckpt_path is not None:
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        del ckpt
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.1f}M params, world={world}, "
              f"tokens/step={cfg['micro_batch'] * cfg['block_size'] * world}, resume step={step}")

    epoch = step // len(train_loader)
    t0 = time.time()
    while step < cfg["max_steps"]:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            if step >= cfg["max_steps"]:
                break
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, cfg)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            optimizer.step()
            step += 1

            if step % 100 == 0 and rank == 0:
                dt = (time.time() - t0) / 100
                t0 = time.time()
                print(f"step {step} loss {loss.item():.4f} lr {lr_at(step, cfg):.2e} {dt * 1000:.0f}ms/it")
            if step % cfg["eval_every"] == 0:
                val_loss = evaluate(model, val_loader, cfg, device)
                if rank == 0:
                    print(f"step {step} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
            if step % cfg["save_every"] == 0:
                save_checkpoint(model, optimizer, step, cfg)
        epoch += 1

    save_checkpoint(model, optimizer, step, cfg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
