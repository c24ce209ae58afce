# Switch-style (top-1) MoE decoder, experts replicated on every GPU, plain data parallel.
# launch: torchrun --standalone --nproc_per_node=4 02_switch_dp_trainer.py --config configs/switch_base.yaml
import argparse
import math
import os
import time
from dataclasses import dataclass, field, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    train_bin: str = "data/pile_subset/train.bin"
    val_bin: str = "data/pile_subset/val.bin"
    out_dir: str = "runs/switch_base"
    vocab_size: int = 32000
    seq_len: int = 512
    dim: int = 512
    heads: int = 8
    layers: int = 8
    n_experts: int = 32
    capacity_factor: float = 1.0
    balance_coef: float = 0.01
    z_coef: float = 1e-3
    batch_size: int = 16          # per GPU
    lr: float = 3e-4
    weight_decay: float = 0.1
    warmup_steps: int = 1000
    total_steps: int = 50000
    grad_clip: float = 1.0
    eval_interval: int = 500
    ckpt_interval: int = 2000
    seed: int = 42
    extra: dict = field(default_factory=dict)


class PackedTokens(Dataset):
    def __init__(self, path, seq_len):
        self.path, self.seq_len = path, seq_len
        self.length = (os.path.getsize(path) // np.dtype(np.uint16).itemsize - 1) // seq_len
        self.arr = None

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self.arr is None:
            self.arr = np.memmap(self.path, dtype=np.uint16, mode="r")
        chunk = np.asarray(self.arr[i * self.seq_len: (i + 1) * self.seq_len + 1], dtype=np.int64)
        t = torch.from_numpy(chunk)
        return t[:-1], t[1:]


class SwitchFFN(nn.Module):
    def __init__(self, dim, n_experts, capacity_factor):
        super().__init__()
        self.n_experts = n_experts
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(n_experts)
        )
        self.last_balance = None
        self.last_z = None
        self.last_dropped = None

    def forward(self, h):
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        n = h.size(0)
        logits = self.router(h).float()
        probs = F.softmax(logits, dim=-1)
        gate, choice = probs.max(dim=-1)

        frac_tokens = torch.bincount(choice, minlength=self.n_experts).float() / n
        frac_probs = probs.mean(0)
        self.last_balance = self.n_experts * torch.sum(frac_tokens * frac_probs)
        self.last_z = torch.logsumexp(logits, dim=-1).square().mean()

        capacity = int(self.capacity_factor * n / self.n_experts)
        out = torch.zeros_like(h)
        kept = 0
        for e in range(self.n_experts):
            idx = torch.nonzero(choice == e, as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            idx = idx[:capacity]
            kept += idx.numel()
            y = self.experts[e](h[idx]) * gate[idx, None]
            out.index_add_(0, idx, y.to(out.dtype))
        self.last_dropped = 1.0 - kept / n
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=True, bias=False)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.moe = SwitchFFN(cfg.dim, cfg.n_experts, cfg.capacity_factor)

    def forward(self, x, mask):
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        x = x + a
        return x + self.moe(self.norm2(x))


class SwitchLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(1, cfg.seq_len, cfg.dim))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        nn.init.normal_(self.pos, std=0.02)
        mask = torch.triu(torch.full((cfg.seq_len, cfg.seq_len), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens):
        T = tokens.size(1)
        x = self.embed(tokens) + self.pos[:, :T]
        mask = self.causal_mask[:T, :T]
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(self.norm(x))


def moe_losses(model):
    layers = [m for m in model.modules() if isinstance(m, SwitchFFN)]
    bal = torch.stack([m.last_balance for m in layers]).mean()
    z = torch.stack([m.last_z for m in layers]).mean()
    dropped = sum(m.last_dropped for m in layers) / len(layers)
    return bal, z, dropped


def cosine_lr(step, cfg):
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
    return 0.1 * cfg.lr + 0.9 * cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    loss_sum = torch.zeros((), device=device)
    tok_count = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        tok_count += y.numel()
    dist.all_reduce(loss_sum)
    dist.all_reduce(tok_count)
    model.train()
    return (loss_sum / tok_count).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    cli = parser.parse_args()
    cfg = Config()
    if cli.config:
        with open(cli.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)
    is_main = rank == 0

    model = SwitchLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "pos" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95))

    train_set = PackedTokens(cfg.train_bin, cfg.seq_len)
    val_set = PackedTokens(cfg.val_bin, cfg.seq_len)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, sampler=val_sampler, num_workers=2)

    writer = None
    if is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(asdict(cfg), f)

    step, epoch = 0, 0
    tic = time.time()
    while step < cfg.total_steps:
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            lr = cosine_lr(step, cfg)
            for g in optimizer.param_groups:
                g["lr"] = lr

            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = model(x)
                ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            bal, z, dropped = moe_losses(model.module)
            loss = ce + cfg.balance_coef * bal + cfg.z_coef * z

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            step += 1

            if step % 50 == 0:
                report = torch.tensor([ce.item(), bal.item(), dropped], device=device)
                dist.all_reduce(report, op=dist.ReduceOp.AVG)
                if is_main:
                    elapsed = time.time() - tic
                    tic = time.time()
                    tok_s = 50 * cfg.batch_size * cfg.seq_len * world_size / elapsed
                    print(f"[{step}] ce={report[0]:.4f} bal={report[1]:.3f} drop={report[2]:.3f} "
                          f"gnorm={gnorm:.2f} lr={lr:.2e} tok/s={tok_s:,.0f}")
                    writer.add_scalar("train/ce", report[0].item(), step)
                    writer.add_scalar("train/balance", report[1].item(), step)
                    writer.add_scalar("train/dropped_frac", report[2].item(), step)
                    writer.add_scalar("train/lr", lr, step)

            if step % cfg.eval_interval == 0:
                val_loss = run_eval(model, val_loader, device)
                if is_main:
                    print(f"[{step}] val_loss={val_loss:.4f} ppl={math.exp(val_loss):.1f}")
                    writer.add_scalar("val/loss", val_loss, step)

            if step % cfg.ckpt_interval == 0 and is_main:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step, "epoch": epoch, "config": asdict(cfg)},
                           os.path.join(cfg.out_dir, f"step_{step:07d}.pt"))

            if step >= cfg.total_steps:
                break
        epoch += 1

    if is_main:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
