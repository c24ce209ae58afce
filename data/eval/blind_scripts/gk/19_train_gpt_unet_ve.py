# GPT pretraining with value-embedding skip and U-net style residual connections.
# Saves best.pt whenever the validation loss improves.
#
#   torchrun --standalone --nproc_per_node=8 train_gpt_unet.py --out_dir logs/unet-d12
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class CastedLinear(nn.Linear):
    def __init__(self, i, o):
        super().__init__(i, o, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight.type_as(x))


class Attention(nn.Module):
    def __init__(self, dim, n_head, max_len):
        super().__init__()
        self.n_head = n_head
        self.qkv = CastedLinear(dim, 3 * dim)
        self.proj = CastedLinear(dim, dim)
        self.proj.weight.detach().zero_()
        self.lamb = nn.Parameter(torch.tensor(0.5))
        hd = dim // n_head
        inv = (1 / 1024) ** torch.linspace(0, 1, hd // 4)
        inv = torch.cat([inv, inv.new_zeros(hd // 4)])
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def rope(self, x):
        T = x.size(1)
        c, s = self.cos[None, :T, None], self.sin[None, :T, None]
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], -1).type_as(x)

    def forward(self, x, ve):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, -1).unbind(2)
        v = (1 - self.lamb) * v + self.lamb * ve.view_as(v)
        q, k = self.rope(norm(q)), self.rope(norm(k))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_head, max_len):
        super().__init__()
        self.attn = Attention(dim, n_head, max_len)
        self.fc = CastedLinear(dim, 4 * dim)
        self.out = CastedLinear(4 * dim, dim)
        self.out.weight.detach().zero_()
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))

    def forward(self, x, ve, x0):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        x = x + self.attn(norm(x), ve)
        return x + self.out(F.relu(self.fc(norm(x))).square())


class GPT(nn.Module):
    def __init__(self, vocab_size=50304, dim=768, n_layer=12, n_head=6, max_len=1024):
        super().__init__()
        assert n_layer % 2 == 0
        self.embed = nn.Embedding(vocab_size, dim)
        self.value_embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([Block(dim, n_head, max_len) for _ in range(n_layer)])
        self.skip_weights = nn.Parameter(torch.ones(n_layer // 2))
        self.lm_head = CastedLinear(dim, vocab_size)
        self.lm_head.weight.detach().zero_()

    def forward(self, idx, targets):
        x = x0 = norm(self.embed(idx))
        ve = self.value_embed(idx)
        n = len(self.blocks) // 2
        skips = []
        for i in range(n):
            x = self.blocks[i](x, ve, x0)
            skips.append(x)
        for i in range(n):
            x = x + self.skip_weights[i] * skips.pop()
            x = self.blocks[n + i](x, ve, x0)
        logits = self.lm_head(norm(x)).float()
        logits = 30 * torch.tanh(logits / 30)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def orthogonalize(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.05, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p.grad)
                st["buf"].lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(st["buf"], group["momentum"])
                p.add_(orthogonalize(g).type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def load_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520
    return np.memmap(path, dtype=np.uint16, mode="r", offset=1024, shape=(int(header[2]),))


def batches(pattern, B, T, rank, world_size):
    files = sorted(glob.glob(pattern))
    n = B * T
    fi, tokens, pos = 0, load_shard(files[0]), 0
    while True:
        if pos + n * world_size + 1 > len(tokens):
            fi = (fi + 1) % len(files)
            tokens, pos = load_shard(files[fi]), 0
        s = pos + rank * n
        buf = torch.from_numpy(tokens[s: s + n + 1].astype(np.int64)).pin_memory().cuda(non_blocking=True)
        pos += n * world_size
        yield buf[:-1].view(B, T), buf[1:].view(B, T)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_files", default="data/fineweb10B/fineweb_train_*.bin")
    ap.add_argument("--val_files", default="data/fineweb10B/fineweb_val_*.bin")
    ap.add_argument("--out_dir", default="logs/unet-d12")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--cooldown_frac", type=float, default=0.4)
    ap.add_argument("--val_every", type=int, default=125)
    ap.add_argument("--val_tokens", type=int, default=10485760)
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    master = rank == 0
    torch.manual_seed(0)

    model = GPT(max_len=args.T).cuda()
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            m.bfloat16()
    hidden = [p for p in model.blocks.parameters() if p.ndim == 2]
    scalars = [p for p in model.parameters() if p.ndim < 2]
    adam = torch.optim.Adam([
        dict(params=[model.embed.weight, model.value_embed.weight], lr=0.6),
        dict(params=[model.lm_head.weight], lr=0.008),
        dict(params=scalars, lr=0.04),
    ], betas=(0.8, 0.95), eps=1e-10, fused=True)
    muon = Muon(hidden, lr=0.05)
    optimizers = [adam, muon]
    for o in optimizers:
        for g in o.param_groups:
            g["initial_lr"] = g["lr"]
    model = DDP(torch.compile(model), device_ids=[local_rank])
    raw = model.module._orig_mod

    def lr_mult(it):
        x = it / args.iters
        return 1.0 if x < 1 - args.cooldown_frac else (1 - x) / args.cooldown_frac

    val_steps = args.val_tokens // (args.B * args.T * world_size)

    def evaluate():
        model.eval()
        loader = batches(args.val_files, args.B, args.T, rank, world_size)
        total = 0.0
        with torch.no_grad():
            for _ in range(val_steps):
                x, y = next(loader)
                total += model(x, y).item()
        model.train()
        return total / val_steps

    train_iter = batches(args.train_files, args.B, args.T, rank, world_size)
    best_val = float("inf")
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.perf_counter()
    for it in range(args.iters + 1):
        last = it == args.iters
        if last or it % args.val_every == 0:
            val_loss = evaluate()
            if master:
                elapsed = time.perf_counter() - t0
                print(f"it {it}/{args.iters} | val_loss {val_loss:.4f} | best {min(best_val, val_loss):.4f} | {elapsed:.0f}s")
                if val_loss < best_val:
                    best_val = val_loss
                    torch.save({"model": raw.state_dict(), "it": it, "val_loss": val_loss},
                               os.path.join(args.out_dir, "best.pt"))
        if last:
            break

        x, y = next(train_iter)
        loss = model(x, y)
        loss.backward()
        m = lr_mult(it)
        for o in optimizers:
            for g in o.param_groups:
                g["lr"] = g["initial_lr"] * m
        for g in muon.param_groups:
            g["momentum"] = 0.85 + 0.1 * min(it / 300, 1)
        for o in optimizers:
            o.step()
        model.zero_grad(set_to_none=True)
        if it % 25 == 0:
            lt = loss.detach()
            dist.all_reduce(lt, op=dist.ReduceOp.AVG)
            if master:
                print(f"it {it} | train_loss {lt.item():.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
