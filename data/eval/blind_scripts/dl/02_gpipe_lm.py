#!/usr/bin/env python
# GPipe-style pipeline training of a decoder-only LM.
# One pipeline, one stage per GPU:
#   torchrun --nproc_per_node=4 02_gpipe_lm.py --config configs/lm_medium.yaml
import argparse
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, Dataset


@dataclass
class Config:
    train_bin: str = "data/owt_train.bin"
    val_bin: str = "data/owt_val.bin"
    vocab_size: int = 50304
    d_model: int = 1024
    n_head: int = 16
    n_layer: int = 24
    seq_len: int = 1024
    batch_size: int = 32
    n_micro: int = 8
    lr: float = 2e-4
    epochs: int = 1
    log_every: int = 10
    val_batches: int = 40
    ckpt_dir: str = "ckpt/gpipe"
    resume: bool = False
    seed: int = 0


class Memmap(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, idx):
        a = idx * self.seq_len
        t = torch.from_numpy(self.tokens[a:a + self.seq_len + 1].astype(np.int64))
        return t[:-1], t[1:]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        T = x.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    """Slice of the LM owned by one pipeline rank."""

    def __init__(self, cfg, stage_id, n_stages):
        super().__init__()
        assert cfg.n_layer % n_stages == 0
        per = cfg.n_layer // n_stages
        self.first, self.last = stage_id == 0, stage_id == n_stages - 1
        if self.first:
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg.d_model, cfg.n_head) for _ in range(per))
        if self.last:
            self.norm = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))
        for layer in self.layers:
            x = layer(x)
        if self.last:
            x = self.head(self.norm(x))
        return x


# --- p2p helpers: a small header with the shape goes first, then the payload ---
HDR = 4


def send_act(t, dst):
    t = t.contiguous()
    hdr = torch.zeros(HDR, dtype=torch.long, device=t.device)
    hdr[0] = t.dim()
    hdr[1:1 + t.dim()] = torch.tensor(t.shape, device=t.device)
    dist.send(hdr, dst)
    dist.send(t, dst)


def recv_act(src, dtype=torch.float32):
    hdr = torch.empty(HDR, dtype=torch.long, device="cuda")
    dist.recv(hdr, src)
    shape = hdr[1:1 + int(hdr[0])].tolist()
    buf = torch.empty(shape, dtype=dtype, device="cuda")
    dist.recv(buf, src)
    return buf


def pipeline_step(stage, cfg, rank, world, inputs, labels, train=True):
    prev, nxt = rank - 1, rank + 1
    in_mb = inputs.chunk(cfg.n_micro)
    lab_mb = labels.chunk(cfg.n_micro)
    stash, losses = [], []
    # forward all micro-batches
    for i in range(cfg.n_micro):
        if stage.first:
            x = in_mb[i].cuda(non_blocking=True)
        else:
            x = recv_act(prev)
            x.requires_grad_(train)
        with torch.set_grad_enabled(train), torch.autocast("cuda", dtype=torch.bfloat16):
            out = stage(x)
        if stage.last:
            y = lab_mb[i].cuda(non_blocking=True)
            loss = F.cross_entropy(out.float().flatten(0, 1), y.flatten()) / cfg.n_micro
            losses.append(loss.detach())
            stash.append((x, loss))
        else:
            out = out.float()
            send_act(out.detach(), nxt)
            stash.append((x, out))
    if not train:
        return torch.stack(losses).sum() if stage.last else None
    # backward all micro-batches, same order on every stage
    for x, out in reversed(stash):
        if stage.last:
            out.backward()
        else:
            g = torch.empty_like(out)
            dist.recv(g, nxt)
            out.backward(g)
        if not stage.first:
            dist.send(x.grad.contiguous(), prev)
    return torch.stack(losses).sum() if stage.last else None


@torch.no_grad()
def clip_global_norm(params, max_norm):
    # the norm is over the whole model, i.e. over all stages
    grads = [q.grad for q in params if q.grad is not None]
    sq = torch.zeros((), device="cuda")
    for gr in grads:
        sq += gr.float().pow(2).sum()
    dist.all_reduce(sq)
    coef = max_norm / (sq.sqrt() + 1e-6)
    if coef < 1:
        for gr in grads:
            gr.mul_(coef)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    cfg.resume = cfg.resume or a.resume

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed + rank)

    stage = Stage(cfg, rank, world).cuda()
    opt = torch.optim.AdamW(stage.parameters(), lr=cfg.lr, weight_decay=0.1)
    ckpt_path = os.path.join(cfg.ckpt_dir, f"stage{rank:02d}.pt")
    start_epoch = 0
    if cfg.resume and os.path.exists(ckpt_path):
        sd = torch.load(ckpt_path, map_location=f"cuda:{local_rank}")
        stage.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        start_epoch = sd["epoch"] + 1

    # A single pipeline: every stage walks the same batches in the same order,
    # so no sampler, just an identically seeded generator.
    train_ds = Memmap(cfg.train_bin, cfg.seq_len)
    val_ds = Memmap(cfg.val_bin, cfg.seq_len)
    g = torch.Generator()
    g.manual_seed(cfg.seed)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, generator=g,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg.batch_size, shuffle=False, drop_last=True)

    for epoch in range(start_epoch, cfg.epochs):
        stage.train()
        t0 = time.time()
        for it, (xb, yb) in enumerate(train_dl):
            opt.zero_grad(set_to_none=True)
            loss = pipeline_step(stage, cfg, rank, world, xb, yb, train=True)
            clip_global_norm(stage.parameters(), 1.0)
            opt.step()
            if stage.last and it % cfg.log_every == 0:
                tok_s = cfg.batch_size * cfg.seq_len * cfg.log_every / (time.time() - t0)
                t0 = time.time()
                print(f"[epoch {epoch} it {it}] loss {loss.item():.4f} tok/s {tok_s:,.0f}", flush=True)

        stage.eval()
        tot, n = 0.0, 0
        with torch.no_grad():
            for i, (xb, yb) in enumerate(val_dl):
                if i >= cfg.val_batches:
                    break
                l = pipeline_step(stage, cfg, rank, world, xb, yb, train=False)
                if stage.last:
                    tot += l.item()
                    n += 1
        if stage.last:
            print(f"epoch {epoch} val_loss {tot / max(n, 1):.4f} ppl {np.exp(tot / max(n, 1)):.2f}", flush=True)

        # each stage owns different parameters, so each writes its own file
        os.makedirs(cfg.ckpt_dir, exist_ok=True)
        torch.save({"model": stage.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
