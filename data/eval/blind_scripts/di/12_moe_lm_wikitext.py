"""
Fine-grained MoE LM (shared expert + 64 routed experts, top-6) in the style of
DeepSeekMoE, trained on WikiText-103 with DDP. Routed experts are small, so all
of them are replicated on every GPU.

  torchrun --nproc_per_node=8 12_moe_lm_wikitext.py --tokens-dir /data/wt103_llama_tok --run wt103_dsmoe
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens-dir", required=True)
    p.add_argument("--run", default="wt103_dsmoe")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-routed", type=int, default=64)
    p.add_argument("--n-shared", type=int, default=1)
    p.add_argument("--expert-hidden", type=int, default=256)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--capacity", type=float, default=1.5)
    p.add_argument("--balance-alpha", type=float, default=0.003)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


class TokenFile(Dataset):
    def __init__(self, path, ctx):
        self.data = np.load(path, mmap_mode="r")
        self.ctx = ctx

    def __len__(self):
        return (len(self.data) - 1) // self.ctx

    def __getitem__(self, i):
        s = i * self.ctx
        seq = torch.from_numpy(self.data[s:s + self.ctx + 1].astype(np.int64))
        return seq[:-1], seq[1:]


class FFN(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class FineGrainedMoE(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.E, self.k, self.cf = a.n_routed, a.topk, a.capacity
        self.shared = FFN(a.dim, a.expert_hidden * a.n_shared)
        self.gate = nn.Linear(a.dim, a.n_routed, bias=False)
        self.routed = nn.ModuleList(FFN(a.dim, a.expert_hidden) for _ in range(a.n_routed))

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
        N = h.size(0)
        scores = self.gate(h).float().softmax(-1)
        topw, topi = scores.topk(self.k, dim=-1)            # DeepSeekMoE does not renormalise

        # expert-level balance loss
        f = torch.bincount(topi.flatten(), minlength=self.E).float() * self.E / (self.k * N)
        balance = (f * scores.mean(0)).sum()

        cap = int(math.ceil(self.cf * N * self.k / self.E))
        e_flat = topi.t().reshape(-1)
        w_flat = topw.t().reshape(-1)
        t_flat = torch.arange(N, device=h.device).repeat(self.k)
        pos = (F.one_hot(e_flat, self.E).cumsum(0) - 1).gather(1, e_flat[:, None]).squeeze(1)
        keep = pos < cap
        e_flat, w_flat, t_flat = e_flat[keep], w_flat[keep], t_flat[keep]
        order = torch.argsort(e_flat, stable=True)
        t_sorted, w_sorted = t_flat[order], w_flat[order]
        counts = torch.bincount(e_flat, minlength=self.E).tolist()

        routed_in = h[t_sorted].split(counts)
        routed_out = torch.cat([ex(chunk) for ex, chunk in zip(self.routed, routed_in)])
        y = self.shared(h)
        y = y.index_add(0, t_sorted, (routed_out * w_sorted[:, None]).to(y.dtype))
        return y.view(B, T, D), balance, 1.0 - keep.float().mean()


class Layer(nn.Module):
    def __init__(self, a, first):
        super().__init__()
        self.nh = a.n_heads
        self.norm_attn = nn.RMSNorm(a.dim)
        self.norm_ffn = nn.RMSNorm(a.dim)
        self.qkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.out = nn.Linear(a.dim, a.dim, bias=False)
        # first layer stays dense, as in the paper
        self.dense = first
        self.ffn = FFN(a.dim, 4 * a.dim) if first else FineGrainedMoE(a)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm_attn(x)).view(B, T, 3, self.nh, -1).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        if self.dense:
            return x + self.ffn(self.norm_ffn(x)), None, None
        y, bal, drop = self.ffn(self.norm_ffn(x))
        return x + y, bal, drop


class LM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.ctx, a.dim)
        self.layers = nn.ModuleList(Layer(a, i == 0) for i in range(a.n_layers))
        self.norm = nn.RMSNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        bals, drops = [], []
        for layer in self.layers:
            x, b, d = layer(x)
            if b is not None:
                bals.append(b)
                drops.append(d)
        return self.lm_head(self.norm(x)), torch.stack(bals).sum(), torch.stack(drops).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _, _ = model(x)
        total_loss += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        total_tokens += y.numel()
    model.train()
    return total_loss / total_tokens


def main():
    a = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_ds = TokenFile(os.path.join(a.tokens_dir, "train.npy"), a.ctx)
    valid_ds = TokenFile(os.path.join(a.tokens_dir, "valid.npy"), a.ctx)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=a.bs, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=a.bs, sampler=valid_sampler, num_workers=2, pin_memory=True)

    model = DDP(LM(a).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = a.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / a.warmup, 0.5 * (1 + math.cos(math.pi * s / total_steps))))

    run_dir = os.path.join("runs", a.run)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(vars(a), f, indent=2)

    best_val = float("inf")
    history = []
    step = 0
    for epoch in range(a.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, balance, drop = model(x)
                ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss = ce + a.balance_alpha * balance
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % a.log_every == 0:
                buf = torch.stack([ce.detach(), balance.detach(), drop.detach()])
                dist.all_reduce(buf, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} ce {buf[0]:.4f} bal {buf[1]:.4f} drop {buf[2]:.2%} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        val_loss = evaluate(model, valid_loader, device)
        if rank == 0:
            ppl = math.exp(val_loss)
            history.append({"epoch": epoch, "val_loss": val_loss, "val_ppl": ppl, "secs": time.time() - t0})
            print(f"== epoch {epoch} valid loss {val_loss:.4f} ppl {ppl:.2f}", flush=True)
            with open(os.path.join(run_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=2)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "val_loss": val_loss}
            torch.save(state, os.path.join(run_dir, "last.pt"))
            if val_loss < best_val:
                best_val = val_loss
                torch.save(state, os.path.join(run_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
