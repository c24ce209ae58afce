"""
GPT training on FineWeb token shards with a local/global attention pattern:
every 4th layer attends globally, the rest use a sliding window.

    torchrun --standalone --nproc_per_node=8 train_gpt_localglobal.py --out_dir logs/lg-d12
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.parallel import DistributedDataParallel as DDP

flex_attention = torch.compile(flex_attention, dynamic=False)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_sliding_mask(window):
    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return sliding


class Attention(nn.Module):
    def __init__(self, dim, n_head, max_len):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        hd = dim // n_head
        inv = (1 / 1024) ** torch.linspace(0, 1, hd // 2)
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def rope(self, x):
        T = x.size(2)
        x1, x2 = x.float().chunk(2, -1)
        c, s = self.cos[:T], self.sin[:T]
        return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], -1).type_as(x)

    def forward(self, x, block_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        q, k = self.rope(norm(q)), self.rope(norm(k))
        y = flex_attention(q, k, v, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_head, max_len, is_global):
        super().__init__()
        self.is_global = is_global
        self.attn = Attention(dim, n_head, max_len)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.proj = nn.Linear(4 * dim, dim, bias=False)
        nn.init.zeros_(self.attn.out.weight)
        nn.init.zeros_(self.proj.weight)

    def forward(self, x, masks):
        x = x + self.attn(norm(x), masks["global" if self.is_global else "local"])
        return x + self.proj(F.relu(self.fc(norm(x))).square())


class GPT(nn.Module):
    def __init__(self, vocab_size=50304, dim=768, n_layer=12, n_head=6, max_len=2048):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([Block(dim, n_head, max_len, (i + 1) % 4 == 0) for i in range(n_layer)])
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        nn.init.zeros_(self.lm_head.weight)

    def forward(self, idx, targets, masks):
        x = norm(self.wte(idx))
        for blk in self.blocks:
            x = blk(x, masks)
        logits = self.lm_head(norm(x)).float()
        logits = 30 * torch.tanh(logits / 30)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def zeropower_ns5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    t = G.size(0) > G.size(1)
    if t:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if t else X


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
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = st["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"])
                p.add_(zeropower_ns5(g).type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def _load_data_shard(filename):
    header = np.fromfile(filename, dtype=np.int32, count=256)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    return np.memmap(filename, dtype=np.uint16, mode="r", offset=1024, shape=(int(header[2]),))


class DistributedDataLoader:
    def __init__(self, filename_pattern, B, T, process_rank, num_processes):
        self.files = sorted(glob.glob(filename_pattern))
        assert len(self.files) > 0
        self.B, self.T = B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        self.reset()

    def reset(self):
        self.current_shard = 0
        self.base = 0
        self.tokens = _load_data_shard(self.files[0])

    def next_batch(self):
        B, T = self.B, self.T
        if self.base + B * T * self.num_processes + 1 > len(self.tokens):
            self.current_shard = (self.current_shard + 1) % len(self.files)
            self.tokens = _load_data_shard(self.files[self.current_shard])
            self.base = 0
        start = self.base + self.process_rank * B * T
        buf = torch.from_numpy(self.tokens[start: start + B * T + 1].astype(np.int64))
        self.base += B * T * self.num_processes
        return buf[:-1].view(B, T).cuda(non_blocking=True), buf[1:].view(B, T).cuda(non_blocking=True)


@torch.no_grad()
def evaluate(model, loader, steps, masks):
    loader.reset()
    loss = torch.zeros((), device="cuda")
    for _ in range(steps):
        x, y = loader.next_batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss += model(x, y, masks)
    loss /= steps
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--input_bin", default="data/fineweb10B/fineweb_train_*.bin")
    ap.add_argument("--input_val_bin", default="data/fineweb10B/fineweb_val_*.bin")
    ap.add_argument("--out_dir", default="logs/lg-d12")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--num_iterations", type=int, default=4000)
    ap.add_argument("--warmdown_iters", type=int, default=1200)
    ap.add_argument("--adam_lr", type=float, default=0.005)
    ap.add_argument("--muon_lr", type=float, default=0.03)
    ap.add_argument("--val_loss_every", type=int, default=250)
    ap.add_argument("--val_tokens", type=int, default=10485760)
    args = ap.parse_args()

    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(ddp_local_rank)
    dist.init_process_group(backend="nccl")
    master_process = ddp_rank == 0

    B, T = args.batch_size, args.seq_len
    train_loader = DistributedDataLoader(args.input_bin, B, T, ddp_rank, ddp_world_size)
    val_loader = DistributedDataLoader(args.input_val_bin, B, T, ddp_rank, ddp_world_size)
    val_steps = args.val_tokens // (B * T * ddp_world_size)

    masks = {
        "global": create_block_mask(causal_mask, None, None, T, T, device="cuda"),
        "local": create_block_mask(make_sliding_mask(args.window), None, None, T, T, device="cuda"),
    }

    torch.manual_seed(0)
    model = GPT(max_len=T).cuda()
    model = torch.compile(model)
    model = DDP(model, device_ids=[ddp_local_rank])
    raw_model = model.module

    hidden = [p for n, p in raw_model.named_parameters() if "blocks" in n and p.ndim == 2]
    adam = torch.optim.Adam([p for n, p in raw_model.named_parameters() if "blocks" not in n],
                            lr=args.adam_lr, betas=(0.9, 0.95), fused=True)
    muon = Muon(hidden, lr=args.muon_lr)
    optimizers = [adam, muon]
    base = [args.adam_lr, args.muon_lr]

    def lr_mult(it):
        if it < args.num_iterations - args.warmdown_iters:
            return 1.0
        return (args.num_iterations - it) / args.warmdown_iters

    if master_process:
        os.makedirs(args.out_dir, exist_ok=True)
        logfile = os.path.join(args.out_dir, "log.txt")

    training_time = 0.0
    for step in range(args.num_iterations + 1):
        last_step = step == args.num_iterations

        if master_process and (last_step or step % args.val_loss_every == 0):
            raw_model.eval()
            val_loss = evaluate(raw_model, val_loader, val_steps, masks)
            raw_model.train()
            msg = f"step:{step}/{args.num_iterations} val_loss:{val_loss:.4f} train_time:{training_time:.1f}s"
            print(msg)
            with open(logfile, "a") as f:
                f.write(msg + "\n")

        if last_step:
            if master_process:
                torch.save({"model": raw_model.state_dict(), "step": step},
                           os.path.join(args.out_dir, f"final_{step:06d}.pt"))
            break

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x, y = train_loader.next_batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y, masks)
        loss.backward()
        m = lr_mult(step)
        for opt, lr in zip(optimizers, base):
            for g in opt.param_groups:
                g["lr"] = lr * m
        for g in muon.param_groups:
            g["momentum"] = 0.85 + 0.1 * min(step / 500, 1)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        training_time += time.perf_counter() - t0

        if step % 10 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if master_process:
                print(f"step:{step + 1} train_loss:{l.item():.4f} step_avg:{1000 * training_time / (step + 1):.1f}ms")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
