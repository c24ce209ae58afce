"""
Wall-clock-budgeted GPT training (e.g. "best val loss in 30 minutes on 8xH100").
Dropout-free GPT with rotary + ReLU^2, Muon + AdamW, bf16, torch.compile.

    torchrun --standalone --nproc_per_node=8 train_budget.py --budget_minutes 30 --wandb
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
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    def __init__(self, hd, max_len):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, x):  # x: B, H, T, D
        T = x.size(2)
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = self.cos[:T], self.sin[:T]
        return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, dim, n_head, max_len):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.rotary = Rotary(dim // n_head, max_len)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(norm(x)).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(norm(q)), self.rotary(norm(k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.relu(self.up(norm(x))).square())


class GPT(nn.Module):
    def __init__(self, vocab, dim, n_layer, n_head, max_len):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, n_head, max_len) for _ in range(n_layer)])
        self.head = nn.Linear(dim, vocab, bias=False)
        for blk in self.blocks:
            nn.init.zeros_(blk.proj.weight)
            nn.init.zeros_(blk.down.weight)
        nn.init.zeros_(self.head.weight)

    def forward(self, idx, targets):
        x = norm(self.embed(idx))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def newton_schulz(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    tr = G.size(0) > G.size(1)
    X = X.T if tr else X
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tr else X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["mom"] = torch.zeros_like(p.grad)
                st["mom"].lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(st["mom"], group["momentum"])
                p.add_(newton_schulz(g).type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_bin", default="data/fineweb_edu/train.bin")
    ap.add_argument("--val_bin", default="data/fineweb_edu/val.bin")
    ap.add_argument("--out_dir", default="out/budget")
    ap.add_argument("--budget_minutes", type=float, default=30.0)
    ap.add_argument("--expected_steps", type=int, default=6000, help="used for the lr cooldown schedule")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--total_batch_tokens", type=int, default=524288)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--n_head", type=int, default=6)
    ap.add_argument("--adam_lr", type=float, default=0.008)
    ap.add_argument("--muon_lr", type=float, default=0.04)
    ap.add_argument("--val_every", type=int, default=250)
    ap.add_argument("--val_tokens", type=int, default=4 * 2**20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb", action="store_true")
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    master = rank == 0
    assert args.total_batch_tokens % (args.batch_size * args.seq_len * world_size) == 0
    grad_accum = args.total_batch_tokens // (args.batch_size * args.seq_len * world_size)

    # per-rank seed: the data sampler below must draw different windows on every rank.
    # DDP broadcasts rank 0's initial weights, so model init can differ here.
    torch.manual_seed(args.seed + rank)
    rng = np.random.default_rng(args.seed + rank)

    train = np.memmap(args.train_bin, dtype=np.uint16, mode="r")
    val = np.memmap(args.val_bin, dtype=np.uint16, mode="r")

    def sample_batch():
        ix = rng.integers(0, len(train) - args.seq_len - 1, size=args.batch_size)
        chunk = torch.from_numpy(np.stack([train[i: i + args.seq_len + 1] for i in ix]).astype(np.int64))
        chunk = chunk.pin_memory().to(device, non_blocking=True)
        return chunk[:, :-1], chunk[:, 1:]

    model = GPT(50304, args.dim, args.n_layer, args.n_head, args.seq_len).to(device)
    hidden = [p for p in model.blocks.parameters() if p.ndim == 2]
    adam = torch.optim.AdamW([model.embed.weight, model.head.weight], lr=args.adam_lr,
                             betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    muon = Muon(hidden, lr=args.muon_lr)
    optimizers = [adam, muon]
    base_lrs = [args.adam_lr, args.muon_lr]
    model = DDP(torch.compile(model), device_ids=[local_rank])

    @torch.no_grad()
    def evaluate():
        model.eval()
        per_rank = args.batch_size * args.seq_len
        steps = args.val_tokens // (per_rank * world_size)
        tot = torch.zeros((), device=device)
        for s in range(steps):
            off = (s * world_size + rank) * per_rank
            buf = torch.from_numpy(val[off: off + per_rank + 1].astype(np.int64)).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                tot += model(buf[:-1].view(args.batch_size, -1), buf[1:].view(args.batch_size, -1))
        dist.all_reduce(tot, op=dist.ReduceOp.SUM)
        model.train()
        return tot.item() / (steps * world_size)

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        if args.wandb:
            wandb.init(project="gpt-budget", config=vars(args))

    budget_s = args.budget_minutes * 60
    stop = torch.zeros(1, dtype=torch.int32, device=device)
    train_time = 0.0
    step = 0
    while True:
        # only rank 0's clock decides, so every rank leaves the loop on the same step
        if master and train_time > budget_s:
            stop.fill_(1)
        dist.broadcast(stop, src=0)
        done = bool(stop.item())

        if step % args.val_every == 0 or done:
            vl = evaluate()
            if master:
                print(f"step {step} | val {vl:.4f} | {train_time / 60:.1f} min")
                if args.wandb:
                    wandb.log({"val_loss": vl, "train_minutes": train_time / 60}, step=step)
        if done:
            break

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        frac = min(step / args.expected_steps, 1.0)
        mult = 1.0 if frac < 0.6 else max(0.05, (1 - frac) / 0.4)
        for opt, lr in zip(optimizers, base_lrs):
            for g in opt.param_groups:
                g["lr"] = lr * mult
        loss_acc = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = sample_batch()
            if micro < grad_accum - 1:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(x, y) / grad_accum
                    loss.backward()
            else:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y) / grad_accum
                loss.backward()
            loss_acc += loss.detach()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        train_time += time.perf_counter() - t0
        step += 1

        if step % 25 == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if master:
                print(f"step {step} | loss {loss_acc.item():.4f} | lr x{mult:.2f}")
                if args.wandb:
                    wandb.log({"train_loss": loss_acc.item(), "lr_mult": mult}, step=step)

    if master:
        torch.save({"model": model.module._orig_mod.state_dict(), "step": step, "args": vars(args)},
                   os.path.join(args.out_dir, "final.pt"))
        if args.wandb:
            wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
