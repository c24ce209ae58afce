#!/usr/bin/env python
# GPT-2 small speedrun fork with periodic checkpoints so preempted jobs can continue.
#
#   torchrun --standalone --nproc_per_node=8 train_gpt.py --ckpt_dir /checkpoints/gpt-d12
#   torchrun --standalone --nproc_per_node=8 train_gpt.py --ckpt_dir /checkpoints/gpt-d12 --resume_from /checkpoints/gpt-d12/latest.pt
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


def rmsnorm(x):
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    def __init__(self, head_dim, max_seq_len=4096, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        t = torch.arange(max_seq_len).float()
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x):
        T = x.size(1)
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.mlp_out = nn.Linear(4 * dim, dim, bias=False)
        self.rotary = Rotary(dim // n_head)
        self.attn_out.weight.data.zero_()
        self.mlp_out.weight.data.zero_()

    def forward(self, x):
        B, T, C = x.shape
        h = rmsnorm(x)
        q, k, v = self.qkv(h).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
        q, k = self.rotary(rmsnorm(q)), self.rotary(rmsnorm(k))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(B, T, C))
        x = x + self.mlp_out(F.relu(self.fc(rmsnorm(x))).square())
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size=50304, n_layer=12, n_head=6, dim=768):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight.data.zero_()

    def forward(self, idx, targets):
        x = rmsnorm(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(rmsnorm(x)).float()
        logits = 15 * torch.tanh(logits / 15)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def newton_schulz5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"])
                p.add_(newton_schulz5(g).type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def read_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520, f"bad magic in {path}"
    return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(int(header[2]),))


class ShardLoader:
    """Sequential reader; each rank takes its own slice of every global batch."""

    def __init__(self, pattern, B, T, rank, world_size):
        self.files = sorted(glob.glob(pattern))
        assert self.files, pattern
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.set_state(0, 0)

    def set_state(self, file_idx, pos):
        self.file_idx, self.pos = file_idx, pos
        self.tokens = read_shard(self.files[self.file_idx])

    def get_state(self):
        return dict(file_idx=self.file_idx, pos=self.pos)

    def next_batch(self):
        n = self.B * self.T
        if self.pos + n * self.world_size + 1 > len(self.tokens):
            self.set_state((self.file_idx + 1) % len(self.files), 0)
        off = self.pos + self.rank * n
        buf = torch.from_numpy(self.tokens[off: off + n + 1].astype(np.int64)).pin_memory()
        self.pos += n * self.world_size
        x = buf[:-1].view(self.B, self.T).cuda(non_blocking=True)
        y = buf[1:].view(self.B, self.T).cuda(non_blocking=True)
        return x, y


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_files", default="data/fineweb10B/fineweb_train_*.bin")
    ap.add_argument("--val_files", default="data/fineweb10B/fineweb_val_*.bin")
    ap.add_argument("--ckpt_dir", default="checkpoints/gpt-d12")
    ap.add_argument("--resume_from", default=None)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--cooldown_frac", type=float, default=0.35)
    ap.add_argument("--embed_lr", type=float, default=0.3)
    ap.add_argument("--head_lr", type=float, default=0.004)
    ap.add_argument("--muon_lr", type=float, default=0.04)
    ap.add_argument("--val_every", type=int, default=200)
    ap.add_argument("--val_tokens", type=int, default=10485760)
    ap.add_argument("--ckpt_every", type=int, default=500)
    return ap.parse_args()


def main():
    args = parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    master = rank == 0
    torch.manual_seed(42)

    model = GPT().cuda()
    model.compile()
    adam = torch.optim.Adam([dict(params=[model.embed.weight], lr=args.embed_lr),
                             dict(params=[model.lm_head.weight], lr=args.head_lr)],
                            betas=(0.8, 0.95), eps=1e-10, fused=True)
    muon = Muon([p for p in model.blocks.parameters() if p.ndim == 2], lr=args.muon_lr)
    optimizers = [adam, muon]
    for opt in optimizers:
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]

    train_loader = ShardLoader(args.train_files, args.batch_size, args.seq_len, rank, world_size)
    start_step = 0
    if args.resume_from:
        ckpt = torch.load(args.resume_from, map_location=f"cuda:{local_rank}")
        model.load_state_dict(ckpt["model"])
        for opt, sd in zip(optimizers, ckpt["optimizers"]):
            opt.load_state_dict(sd)
        train_loader.set_state(**ckpt["loader"])
        start_step = ckpt["step"]
        del ckpt

    model = DDP(model, device_ids=[local_rank])

    def lr_mult(step):
        x = step / args.steps
        return 1.0 if x < 1 - args.cooldown_frac else max((1 - x) / args.cooldown_frac, 0.0)

    val_steps = args.val_tokens // (args.batch_size * args.seq_len * world_size)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    if master:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"starting at step {start_step}, {world_size} ranks, {val_steps} val steps")

    t0 = time.perf_counter()
    for step in range(start_step, args.steps + 1):
        last = step == args.steps
        if last or step % args.val_every == 0:
            model.eval()
            val_loader = ShardLoader(args.val_files, args.batch_size, args.seq_len, rank, world_size)
            vloss = torch.zeros((), device="cuda")
            with torch.no_grad(), ctx:
                for _ in range(val_steps):
                    vloss += model(*val_loader.next_batch())
            vloss /= val_steps
            dist.all_reduce(vloss, op=dist.ReduceOp.AVG)
            if master:
                elapsed = time.perf_counter() - t0
                print(f"step {step}/{args.steps} val_loss {vloss.item():.4f} elapsed {elapsed:.0f}s")
            model.train()

        if master and step > start_step and (last or step % args.ckpt_every == 0):
            state = dict(
                model=model.state_dict(),
                optimizers=[o.state_dict() for o in optimizers],
                loader=train_loader.get_state(),
                step=step,
                args=vars(args),
            )
            path = os.path.join(args.ckpt_dir, f"step_{step:06d}.pt")
            torch.save(state, path)
            tmp = os.path.join(args.ckpt_dir, "latest.pt.tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(args.ckpt_dir, "latest.pt"))
            print(f"saved {path}")
        if last:
            break

        x, y = train_loader.next_batch()
        with ctx:
            loss = model(x, y)
        loss.backward()
        m = lr_mult(step)
        for opt in optimizers:
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * m
        frac = min(step / 300, 1)
        for g in muon.param_groups:
            g["momentum"] = (1 - frac) * 0.85 + frac * 0.95
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)

        if step % 20 == 0:
            loss = loss.detach()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            if master:
                print(f"step {step} train_loss {loss.item():.4f}")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
