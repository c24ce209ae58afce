"""
nanoGPT-style training script for a small top-2 MoE GPT.

single node, 8 GPUs:
    torchrun --standalone --nproc_per_node=8 14_moe_nanogpt_style.py
"""
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
out_dir = "out-moe-owt"
dataset = "openwebtext"
eval_interval = 1000
eval_iters = 100
log_interval = 10
always_save_checkpoint = False
gradient_accumulation_steps = 5 * 8  # global, split over the ranks below
batch_size = 12
block_size = 1024
n_layer, n_head, n_embd = 12, 12, 768
n_experts, top_k, capacity_factor = 8, 2, 1.25
aux_loss_coef, router_z_coef = 0.01, 0.001
learning_rate, min_lr = 6e-4, 6e-5
max_iters, warmup_iters, lr_decay_iters = 200000, 2000, 200000
weight_decay, beta1, beta2, grad_clip = 1e-1, 0.9, 0.95, 1.0
seed = 1337
# -----------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class ExpertMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class MoEMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleList([ExpertMLP() for _ in range(n_experts)])
        self.aux_loss = None
        self.z_loss = None
        self.tokens_dropped = None

    def forward(self, x):
        B, T, C = x.size()
        x = x.view(-1, C)
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        topv, topi = probs.topk(top_k, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        self.aux_loss = n_experts * (F.one_hot(topi, n_experts).float().mean((0, 1)) * probs.mean(0)).sum()
        self.z_loss = torch.logsumexp(logits, -1).square().mean()
        cap = int(capacity_factor * x.size(0) * top_k / n_experts)
        out = torch.zeros_like(x)
        kept = 0
        for i, expert in enumerate(self.experts):
            rows, which = torch.where(topi == i)
            if rows.numel() == 0:
                continue
            rows, which = rows[:cap], which[:cap]
            kept += rows.numel()
            out.index_add_(0, rows, (expert(x[rows]) * topv[rows, which].unsqueeze(-1)).to(out.dtype))
        self.tokens_dropped = topi.numel() - kept
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MoEMLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MoEGPT(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def router_losses(self):
        aux = torch.stack([b.mlp.aux_loss for b in self.h]).mean()
        z = torch.stack([b.mlp.z_loss for b in self.h]).mean()
        return aux, z

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2), fused=True)


ddp_local_rank = int(os.environ["LOCAL_RANK"])
device = f"cuda:{ddp_local_rank}"
torch.cuda.set_device(device)
dist.init_process_group(backend="nccl")
ddp_rank = dist.get_rank()
ddp_world_size = dist.get_world_size()
master_process = ddp_rank == 0
assert gradient_accumulation_steps % ddp_world_size == 0
gradient_accumulation_steps //= ddp_world_size
torch.manual_seed(seed + ddp_rank)
torch.backends.cuda.matmul.allow_tf32 = True
if master_process:
    os.makedirs(out_dir, exist_ok=True)

data_dir = os.path.join("data", dataset)


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return (x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True))


with open(os.path.join(data_dir, "meta.pkl"), "rb") as f:
    vocab_size = pickle.load(f).get("vocab_size", 50304)

model = MoEGPT(vocab_size).to(device)
optimizer = model.configure_optimizers()
model = DDP(model, device_ids=[ddp_local_rank], find_unused_parameters=True)
raw_model = model.module
ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters, device=device)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss
        m = losses.mean()
        dist.all_reduce(m, op=dist.ReduceOp.AVG)
        out[split] = m.item()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


iter_num, best_val_loss = 0, 1e9
X, Y = get_batch("train")
t0 = time.time()
while iter_num <= max_iters:
    lr = get_lr(iter_num)
    for g in optimizer.param_groups:
        g["lr"] = lr

    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss or always_save_checkpoint:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                                "iter_num": iter_num, "best_val_loss": best_val_loss},
                               os.path.join(out_dir, "ckpt.pt"))

    for micro_step in range(gradient_accumulation_steps):
        model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, lm_loss = model(X, Y)
            aux, z = model.router_losses()
            loss = (lm_loss + aux_loss_coef * aux + router_z_coef * z) / gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    if iter_num % log_interval == 0:
        dropped = torch.tensor(sum(b.mlp.tokens_dropped for b in raw_model.h), device=device, dtype=torch.float)
        lossf = lm_loss.detach().clone()
        dist.all_reduce(lossf, op=dist.ReduceOp.AVG)
        dist.all_reduce(dropped)
        if master_process:
            dt = time.time() - t0
            total_assign = top_k * batch_size * block_size * n_layer * ddp_world_size
            print(f"iter {iter_num}: loss {lossf.item():.4f}, aux {aux.item():.4f}, "
                  f"dropped {dropped.item() / total_assign:.2%}, time {dt * 1000:.0f}ms")
    t0 = time.time()
    iter_num += 1

dist.destroy_process_group()
