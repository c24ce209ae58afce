"""
Samba-style hybrid: Mamba-2 layers interleaved with sliding-window attention,
trained on 16k-token packed rows. Document boundaries are respected in both
mixers (seq_idx for the SSD scan, cu_seqlens for flash-attention varlen).

    torchrun --nproc_per_node=8 08_samba_hybrid_swa.py --config configs/samba_421m.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from flash_attn import flash_attn_varlen_func
from flash_attn.layers.rotary import RotaryEmbedding
from mamba_ssm.modules.mamba2 import Mamba2
from mamba_ssm.ops.triton.layer_norm import RMSNorm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    d_model=1024, n_layer=24, n_head=16, window=2048, attn_every=4, vocab_size=32000,
    seq_len=16384, eos_id=2, lr=8e-4, min_lr=8e-5, warmup=1500, max_steps=60000,
    micro_bs=1, wd=0.1, log_every=20, eval_every=1000, save_every=4000,
    train_path="data/train_16k.u16", val_path="data/val_16k.u16", out_dir="runs/samba",
)


class SWAttention(nn.Module):
    def __init__(self, d_model, n_head, window):
        super().__init__()
        self.n_head, self.head_dim, self.window = n_head, d_model // n_head, window
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim)

    def forward(self, x, cu_seqlens, max_seqlen):
        B, L, D = x.shape
        qkv = self.qkv(x).view(B, L, 3, self.n_head, self.head_dim)
        qkv = self.rotary(qkv, seqlen_offset=0)
        q, k, v = qkv.reshape(B * L, 3, self.n_head, self.head_dim).unbind(1)
        o = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                   causal=True, window_size=(self.window - 1, 0))
        return self.proj(o.reshape(B, L, D))


class SwiGLU(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        hidden = int(8 * d_model / 3 / 64) * 64
        self.w12 = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


class HybridBlock(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.use_attn = (layer_idx % cfg["attn_every"]) == cfg["attn_every"] - 1
        self.norm1 = RMSNorm(cfg["d_model"])
        self.mamba = Mamba2(cfg["d_model"], d_state=128, headdim=64, layer_idx=layer_idx)
        self.attn = SWAttention(cfg["d_model"], cfg["n_head"], cfg["window"])
        self.norm2 = RMSNorm(cfg["d_model"])
        self.mlp = SwiGLU(cfg["d_model"])

    def forward(self, x, seq_idx, cu_seqlens, max_seqlen):
        h = self.norm1(x)
        if self.use_attn:
            h = self.attn(h, cu_seqlens, max_seqlen)
        else:
            h = self.mamba(h, seq_idx=seq_idx)
        x = x + h
        return x + self.mlp(self.norm2(x))


class Samba(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["d_model"])
        self.blocks = nn.ModuleList([HybridBlock(cfg, i) for i in range(cfg["n_layer"])])
        self.norm_f = RMSNorm(cfg["d_model"])
        self.lm_head = nn.Linear(cfg["d_model"], cfg["vocab_size"], bias=False)
        self.lm_head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, seq_idx, cu_seqlens, max_seqlen):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x, seq_idx, cu_seqlens, max_seqlen)
        return self.lm_head(self.norm_f(x))


def boundaries(inp, eos_id):
    """seq_idx (B, L) int32 and flattened cu_seqlens for flash-attn varlen."""
    B, L = inp.shape
    start = torch.zeros_like(inp, dtype=torch.int32)
    start[:, 1:] = (inp[:, :-1] == eos_id).int()
    seq_idx = torch.cumsum(start, dim=1, dtype=torch.int32)
    start[:, 0] = 1
    flat_starts = torch.nonzero(start.flatten(), as_tuple=False).flatten().int()
    cu = torch.cat([flat_starts, torch.tensor([B * L], device=inp.device, dtype=torch.int32)])
    max_seqlen = int((cu[1:] - cu[:-1]).max().item())
    return seq_idx, cu, max_seqlen


class TokenRows(Dataset):
    def __init__(self, path, seq_len):
        self.tok = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tok) - 1) // self.seq_len

    def __getitem__(self, i):
        a = self.tok[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return torch.from_numpy(a.astype(np.int64))


def lr_schedule(step, c):
    if step < c["warmup"]:
        return c["lr"] * step / c["warmup"]
    t = min(1.0, (step - c["warmup"]) / (c["max_steps"] - c["warmup"]))
    return c["min_lr"] + 0.5 * (c["lr"] - c["min_lr"]) * (1 + math.cos(math.pi * t))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)

    model = Samba(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["wd"]},
                             {"params": other, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95), fused=True)

    train_ds = TokenRows(cfg["train_path"], cfg["seq_len"])
    val_ds = TokenRows(cfg["val_path"], cfg["seq_len"])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1337, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["micro_bs"], sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))[:32]
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=cfg["micro_bs"])

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        n_attn = sum(b.use_attn for b in model.module.blocks)
        print(f"{cfg['n_layer']} layers ({n_attn} SWA), world {world}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params")

    step, epoch = 0, 0
    tic = time.time()
    while step < cfg["max_steps"]:
        sampler.set_epoch(epoch)
        for row in loader:
            row = row.to(device, non_blocking=True)
            inp, tgt = row[:, :-1], row[:, 1:]
            seq_idx, cu, max_len = boundaries(inp, cfg["eos_id"])
            for g in opt.param_groups:
                g["lr"] = lr_schedule(step, cfg)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, seq_idx, cu, max_len)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % cfg["log_every"] == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = time.time() - tic
                    tps = cfg["log_every"] * world * inp.numel() / dt
                    print(f"step {step} loss {l.item():.4f} gnorm {norm:.2f} {tps / 1e3:.0f}k tok/s")
                tic = time.time()

            if step % cfg["eval_every"] == 0:
                model.eval()
                acc = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for vrow in val_loader:
                        vrow = vrow.to(device)
                        vi, vt = vrow[:, :-1], vrow[:, 1:]
                        s_idx, vcu, vmax = boundaries(vi, cfg["eos_id"])
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            vl = model.module(vi, s_idx, vcu, vmax)
                        acc[0] += F.cross_entropy(vl.float().flatten(0, 1), vt.flatten(), reduction="sum")
                        acc[1] += vt.numel()
                dist.all_reduce(acc)
                if rank == 0:
                    print(f"step {step} val_loss {(acc[0] / acc[1]).item():.4f}")
                model.train()

            if step % cfg["save_every"] == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step, "cfg": cfg},
                           os.path.join(cfg["out_dir"], f"step_{step}.pt"))
            if step >= cfg["max_steps"]:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
