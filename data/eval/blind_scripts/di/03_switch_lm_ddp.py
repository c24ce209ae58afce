"""Switch Transformer (top-1 routing) LM on a pre-tokenized corpus, DDP with replicated experts.

Launch:
    torchrun --standalone --nproc_per_node=4 03_switch_lm_ddp.py --config configs/switch_base_8e.yaml
"""
import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    dataset_path: str = "/data/c4_en_tok1024"
    out_dir: str = "out/switch_base_8e"
    vocab_size: int = 32128
    seq_len: int = 1024
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    d_ff: int = 3072
    n_experts: int = 8
    capacity_factor: float = 1.25
    jitter: float = 0.01
    dropout: float = 0.1
    micro_batch: int = 16
    grad_accum: int = 4
    lr: float = 6e-4
    warmup_steps: int = 1000
    max_steps: int = 50_000
    weight_decay: float = 0.1
    balance_coef: float = 0.01
    z_coef: float = 0.001
    log_interval: int = 10
    eval_interval: int = 500
    eval_batches: int = 40
    seed: int = 42


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--override", nargs="*", default=[])
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, type(getattr(cfg, k))(v))
    for kv in ns.override:
        k, v = kv.split("=", 1)
        setattr(cfg, k, type(getattr(cfg, k))(v))
    return cfg


class SwitchFFN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_experts = cfg.n_experts
        self.capacity_factor = cfg.capacity_factor
        self.jitter = cfg.jitter
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList([
            nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.ReLU(), nn.Dropout(cfg.dropout),
                          nn.Linear(cfg.d_ff, cfg.d_model))
            for _ in range(cfg.n_experts)
        ])

    def forward(self, x):
        B, T, D = x.shape
        xf = x.reshape(-1, D)
        n_tokens = xf.size(0)
        if self.training and self.jitter > 0:
            xf_r = xf * torch.empty_like(xf).uniform_(1 - self.jitter, 1 + self.jitter)
        else:
            xf_r = xf
        logits = self.router(xf_r.float())
        probs = torch.softmax(logits, dim=-1)
        gate, expert_idx = probs.max(dim=-1)

        capacity = int(self.capacity_factor * n_tokens / self.n_experts)
        out = torch.zeros_like(xf)
        kept = 0
        for e, expert in enumerate(self.experts):
            sel = torch.nonzero(expert_idx == e, as_tuple=True)[0]
            if sel.numel() == 0:
                continue
            sel = sel[:capacity]
            kept += sel.numel()
            out[sel] = (expert(xf[sel]) * gate[sel, None]).to(out.dtype)

        frac_tokens = F.one_hot(expert_idx, self.n_experts).float().mean(0)
        frac_probs = probs.mean(0)
        balance = self.n_experts * torch.sum(frac_tokens * frac_probs)
        z = torch.logsumexp(logits, dim=-1).square().mean()
        stats = {"drop": 1.0 - kept / n_tokens, "max_load": frac_tokens.max().item()}
        return out.view(B, T, D), balance, z, stats


class Layer(nn.Module):
    def __init__(self, cfg, sparse):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.n_head, dropout=cfg.dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.sparse = sparse
        if sparse:
            self.ff = SwitchFFN(cfg)
        else:
            self.ff = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.ReLU(), nn.Dropout(cfg.dropout),
                                    nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, mask):
        h = self.ln_1(x)
        x = x + self.drop(self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0])
        if self.sparse:
            h, bal, z, stats = self.ff(self.ln_2(x))
            return x + self.drop(h), bal, z, stats
        return x + self.drop(self.ff(self.ln_2(x))), None, None, None


class SwitchLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList([Layer(cfg, sparse=(i % 2 == 1)) for i in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.register_buffer("causal", torch.triu(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool), 1),
                             persistent=False)

    def forward(self, ids, labels=None):
        T = ids.size(1)
        x = self.wte(ids) + self.wpe(torch.arange(T, device=ids.device))
        bal_sum, z_sum, all_stats = 0.0, 0.0, []
        for layer in self.layers:
            x, bal, z, stats = layer(x, self.causal[:T, :T])
            if bal is not None:
                bal_sum, z_sum = bal_sum + bal, z_sum + z
                all_stats.append(stats)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1))
        return logits, loss, bal_sum, z_sum, all_stats


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch], dtype=torch.long)
    return ids


def get_lr(it, cfg):
    if it < cfg.warmup_steps:
        return cfg.lr * it / cfg.warmup_steps
    ratio = (it - cfg.warmup_steps) / (cfg.max_steps - cfg.warmup_steps)
    return 0.1 * cfg.lr + 0.9 * cfg.lr * 0.5 * (1.0 + math.cos(math.pi * ratio))


@torch.no_grad()
def estimate_val_loss(model, loader, cfg, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, ids in enumerate(loader):
        if i == cfg.eval_batches:
            break
        ids = ids.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            _, loss, _, _, _ = model(ids, labels=ids)
        tot += torch.stack([loss.float(), torch.ones((), device=device)])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    ds = load_from_disk(cfg.dataset_path)
    train_ds, val_ds = ds["train"], ds["validation"]
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.micro_batch, sampler=val_sampler, collate_fn=collate,
                            num_workers=2, pin_memory=True)

    model = SwitchLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    raw = model.module

    decay, no_decay = [], []
    for n, p in raw.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))

    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"params: {sum(p.numel() for p in raw.parameters()) / 1e6:.1f}M  world={world_size}")

    step, epoch = 0, 0
    data_iter = iter(train_loader)
    train_sampler.set_epoch(epoch)
    t_last = time.time()
    while step < cfg.max_steps:
        lr = get_lr(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        for micro in range(cfg.grad_accum):
            try:
                ids = next(data_iter)
            except StopIteration:
                epoch += 1
                train_sampler.set_epoch(epoch)
                data_iter = iter(train_loader)
                ids = next(data_iter)
            ids = ids.to(device, non_blocking=True)
            model.require_backward_grad_sync = micro == cfg.grad_accum - 1
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                _, lm_loss, bal, z, stats = model(ids, labels=ids)
                loss = lm_loss + cfg.balance_coef * bal + cfg.z_coef * z
            (loss / cfg.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % cfg.log_interval == 0:
            logged = torch.tensor([lm_loss.item(), bal.item(), sum(s["drop"] for s in stats) / len(stats)],
                                  device=device)
            dist.all_reduce(logged, op=dist.ReduceOp.AVG)
            if master:
                dt = (time.time() - t_last) / cfg.log_interval
                t_last = time.time()
                print(f"step {step:6d} | loss {logged[0]:.4f} | balance {logged[1]:.3f} | "
                      f"drop {logged[2]:.3%} | lr {lr:.2e} | {dt:.2f}s/step")

        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            val_loss = estimate_val_loss(model, val_loader, cfg, device)
            if master:
                print(f"step {step}: val loss {val_loss:.4f}, ppl {math.exp(val_loss):.2f}")
                torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step, "config": dataclasses.asdict(cfg)},
                           os.path.join(cfg.out_dir, f"ckpt_{step:06d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
