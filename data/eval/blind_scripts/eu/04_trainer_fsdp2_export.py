"""FSDP2 trainer for decoder-only LMs (infra reference recipe).

- per-block fully_shard + root fully_shard, bf16 params / fp32 reduce
- sharded DCP checkpoints during training, resumable on any world size
- consolidated single-file export at the end for the eval harness

Example:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        04_trainer_fsdp2_export.py run.name=lm-760m model.n_layers=24 model.dim=1536
"""
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DEFAULTS = OmegaConf.create({
    "run": {"name": "lm", "root": "/fsx/runs", "seed": 7},
    "data": {"train": "/fsx/data/pile_tok/train.bin", "val": "/fsx/data/pile_tok/val.bin", "workers": 4},
    "model": {"vocab": 50304, "dim": 1536, "n_layers": 24, "n_heads": 12, "seq_len": 2048, "dropout": 0.0},
    "optim": {"lr": 2.5e-4, "min_lr": 2.5e-5, "warmup": 1000, "steps": 30000, "wd": 0.1, "clip": 1.0,
              "micro_bs": 8},
    "ckpt": {"every": 2000, "keep_last": 3},
})


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_heads, dropout):
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_heads, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LM(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.tok = nn.Embedding(m.vocab, m.dim)
        self.pos = nn.Embedding(m.seq_len, m.dim)
        self.blocks = nn.ModuleList([Block(m.dim, m.n_heads, m.dropout) for _ in range(m.n_layers)])
        self.ln_f = nn.LayerNorm(m.dim)
        self.head = nn.Linear(m.dim, m.vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class Tokens(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return len(self.arr) // (self.seq_len + 1)

    def __getitem__(self, i):
        n = self.seq_len + 1
        t = torch.from_numpy(self.arr[i * n:(i + 1) * n].astype(np.int64))
        return t[:-1], t[1:]


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device(f"cuda:{self.local_rank}")
        self.run_dir = os.path.join(cfg.run.root, cfg.run.name)
        if self.rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            OmegaConf.save(cfg, os.path.join(self.run_dir, "config.yaml"))
        dist.barrier()

        torch.manual_seed(cfg.run.seed)
        model = LM(cfg.model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.optim.wd)
        self.step = 0

        tr = Tokens(cfg.data.train, cfg.model.seq_len)
        va = Tokens(cfg.data.val, cfg.model.seq_len)
        self.sampler = DistributedSampler(tr, shuffle=True, seed=cfg.run.seed, drop_last=True)
        self.train_loader = DataLoader(tr, batch_size=cfg.optim.micro_bs, sampler=self.sampler,
                                       num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
        self.val_loader = DataLoader(va, batch_size=cfg.optim.micro_bs,
                                     sampler=DistributedSampler(va, shuffle=False),
                                     num_workers=cfg.data.workers)

    def lr(self):
        o = self.cfg.optim
        if self.step < o.warmup:
            return o.lr * (self.step + 1) / o.warmup
        r = (self.step - o.warmup) / max(1, o.steps - o.warmup)
        return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1 + math.cos(math.pi * min(r, 1.0)))

    def ckpt_path(self, step):
        return os.path.join(self.run_dir, "checkpoints", f"{step:08d}")

    def save(self):
        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optim": osd, "step": self.step}, checkpoint_id=self.ckpt_path(self.step))
        if self.rank == 0:
            print(f"[ckpt] saved {self.ckpt_path(self.step)}", flush=True)

    def try_resume(self):
        root = os.path.join(self.run_dir, "checkpoints")
        if not os.path.isdir(root):
            return
        done = sorted(d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, ".metadata")))
        if not done:
            return
        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, checkpoint_id=os.path.join(root, done[-1]))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = int(state["step"])
        if self.rank == 0:
            print(f"[ckpt] resumed from {done[-1]} (step {self.step})", flush=True)

    @torch.no_grad()
    def evaluate(self, max_batches=50):
        self.model.eval()
        s = torch.zeros(2, device=self.device)
        for i, (x, y) in enumerate(self.val_loader):
            if i >= max_batches:
                break
            x, y = x.to(self.device), y.to(self.device)
            logits = self.model(x)
            s[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            s[1] += y.numel()
        dist.all_reduce(s)
        self.model.train()
        return (s[0] / s[1]).item()

    def export_consolidated(self):
        """Single-file bf16 state dict that the eval harness loads without torch.distributed."""
        full_sd = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        full_sd = {k: v.to(torch.bfloat16) for k, v in full_sd.items()}
        torch.save(full_sd, os.path.join(self.run_dir, "consolidated.pt"))

    def fit(self):
        cfg = self.cfg
        self.try_resume()
        epoch = self.step // len(self.train_loader)
        self.sampler.set_epoch(epoch)
        it = iter(self.train_loader)
        t0 = time.time()
        while self.step < cfg.optim.steps:
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                self.sampler.set_epoch(epoch)
                it = iter(self.train_loader)
                continue
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            for g in self.opt.param_groups:
                g["lr"] = self.lr()
            loss = F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1

            if self.step % 25 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if self.rank == 0:
                    print(f"step {self.step} loss {l.item():.4f} lr {self.lr():.2e} "
                          f"{(time.time() - t0) / 25 * 1000:.0f} ms/step", flush=True)
                t0 = time.time()
            if self.step % cfg.ckpt.every == 0:
                self.save()
                v = self.evaluate()
                if self.rank == 0:
                    print(f"step {self.step} val_loss {v:.4f}", flush=True)

        self.save()
        self.export_consolidated()
        dist.barrier()
        dist.destroy_process_group()


def main():
    cfg = OmegaConf.merge(DEFAULTS, OmegaConf.from_cli(sys.argv[1:]))
    Trainer(cfg).fit()


if __name__ == "__main__":
    main()
