"""GPT pretraining with FSDP2 (fully_shard), meta-device init and DCP checkpoints.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29400 02_gpt_fsdp2_meta_init.py --config configs/gpt_1p3b.yaml
"""
import argparse
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class Config:
    data_dir: str = "/lustre/datasets/fineweb-edu-gpt2"
    ckpt_dir: str = "/lustre/checkpoints/gpt-1p3b"
    vocab_size: int = 50304
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 16
    seq_len: int = 2048
    micro_batch: int = 8
    lr: float = 2e-4
    min_lr: float = 2e-5
    warmup: int = 1500
    max_steps: int = 40000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    act_ckpt: bool = True
    log_every: int = 20
    eval_every: int = 500
    eval_iters: int = 40
    save_every: int = 1000
    seed: int = 0


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.fc_out = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)
        self.use_ckpt = cfg.act_ckpt

    def _attn(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def _forward(self, x):
        x = x + self._attn(self.ln1(x))
        x = x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return x

    def forward(self, x):
        if self.use_ckpt and self.training:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self):
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.cfg.n_layers))
            elif p.ndim >= 2:
                nn.init.normal_(p, mean=0.0, std=std)
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


class TokenBin(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        buf = torch.from_numpy(self.tokens[s:s + self.seq_len + 1].astype(np.int64))
        return buf[:-1], buf[1:]


class TrainState(Stateful):
    """Bundles model + optimizer so DCP can reshard them on load."""

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer,
                       model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])


def cosine_lr(step, cfg):
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / (cfg.max_steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def latest_step(ckpt_dir):
    if not os.path.isdir(ckpt_dir):
        return None
    steps = [int(d.split("_")[1]) for d in os.listdir(ckpt_dir)
             if d.startswith("step_") and os.path.exists(os.path.join(ckpt_dir, d, ".metadata"))]
    return max(steps) if steps else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = Config()
    if args.config:
        with open(args.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    # Build on meta so no rank ever materialises the full fp32 model.
    with torch.device("meta"):
        model = GPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    model.init_weights()

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay, foreach=True)
    state = TrainState(model, optimizer)

    start = 0
    resume_step = latest_step(cfg.ckpt_dir)
    if resume_step is not None:
        dcp.load({"train": state}, checkpoint_id=os.path.join(cfg.ckpt_dir, f"step_{resume_step}"))
        start = resume_step
        if rank == 0:
            print(f"resumed from step {resume_step}")

    train_ds = TokenBin(os.path.join(cfg.data_dir, "train.bin"), cfg.seq_len)
    val_ds = TokenBin(os.path.join(cfg.data_dir, "val.bin"), cfg.seq_len)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.micro_batch, sampler=val_sampler, num_workers=2)

    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{n / 1e9:.2f}B params on {world} GPUs; config={asdict(cfg)}")

    epoch = start // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(start % len(loader)):
        next(it)

    model.train()
    t0 = time.perf_counter()
    for step in range(start, cfg.max_steps):
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)

        lr = cosine_lr(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if isinstance(gnorm, DTensor):
            gnorm = gnorm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % cfg.log_every == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.perf_counter() - t0) / cfg.log_every
                print(f"step {step} | loss {l.item():.4f} | gnorm {gnorm.item():.2f} | lr {lr:.2e} | "
                      f"{cfg.micro_batch * cfg.seq_len * world / dt:,.0f} tok/s")
            t0 = time.perf_counter()

        if (step + 1) % cfg.eval_every == 0:
            model.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                for i, (vx, vy) in enumerate(val_loader):
                    if i == cfg.eval_iters:
                        break
                    vx, vy = vx.to(device), vy.to(device)
                    out = model(vx)
                    acc[0] += F.cross_entropy(out.float().flatten(0, 1), vy.flatten(), reduction="sum")
                    acc[1] += vy.numel()
            dist.all_reduce(acc)
            if rank == 0:
                print(f"step {step + 1} | val loss {(acc[0] / acc[1]).item():.4f}")
            model.train()

        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.max_steps:
            dcp.save({"train": state}, checkpoint_id=os.path.join(cfg.ckpt_dir, f"step_{step + 1}"))
            if rank == 0:
                print(f"saved step {step + 1}")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
