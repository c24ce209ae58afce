"""
GPipe-style pipeline training of a small GPT, one stage per GPU.

Each rank owns a contiguous slice of the transformer blocks. Activations go
forward and activation gradients go backward with point-to-point send/recv.
Stage 0 owns the token embedding and reads the data; the last stage owns the
LM head and receives the targets from stage 0.

    torchrun --nproc_per_node=4 02_pipeline_gpt_stages.py --data tokens.bin
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


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="uint16 token file")
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--n-micro", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--save-dir", default="ckpt_pipe")
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        T = x.size(1)
        mask = torch.triu(torch.ones(T, T, device=x.device, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    def __init__(self, args, stage, n_stages):
        super().__init__()
        self.first = stage == 0
        self.last = stage == n_stages - 1
        per = math.ceil(args.n_layer / n_stages)
        lo, hi = stage * per, min(args.n_layer, (stage + 1) * per)
        if self.first:
            self.tok = nn.Embedding(args.vocab_size, args.d_model)
            self.pos = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList([Block(args.d_model, args.n_head) for _ in range(lo, hi)])
        if self.last:
            self.ln_f = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)

    def forward(self, x):
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.tok(x) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


class TokenStream:
    """Random windows from a flat token file; only stage 0 reads it."""

    def __init__(self, path, seq_len, seed):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)

    def batch(self, bs):
        ix = self.rng.integers(0, len(self.data) - self.seq_len - 1, size=bs)
        x = np.stack([self.data[i:i + self.seq_len] for i in ix]).astype(np.int64)
        y = np.stack([self.data[i + 1:i + 1 + self.seq_len] for i in ix]).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)


def lr_lambda(step, args):
    if step < args.warmup:
        return (step + 1) / args.warmup
    prog = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog))


def train_step(model, optimizer, stream, args, rank, n_stages, device):
    first, last = rank == 0, rank == n_stages - 1
    act_shape = (args.micro_batch, args.seq_len, args.d_model)
    inputs, outputs, losses = [], [], []

    # forward all micro-batches
    for _ in range(args.n_micro):
        if last:
            y = torch.empty(args.micro_batch, args.seq_len, dtype=torch.long, device=device)
            dist.recv(y, src=0)
        if first:
            x, y = stream.batch(args.micro_batch)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            dist.send(y, dst=n_stages - 1)
            inp = x
        else:
            inp = torch.empty(act_shape, device=device)
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_(True)
        out = model(inp)
        if last:
            loss = F.cross_entropy(out.view(-1, out.size(-1)), y.view(-1)) / args.n_micro
            losses.append(loss)
        else:
            dist.send(out.detach(), dst=rank + 1)
        inputs.append(inp)
        outputs.append(out)

    # backward in reverse order
    for i in reversed(range(args.n_micro)):
        if last:
            losses[i].backward()
        else:
            grad = torch.empty(act_shape, device=device)
            dist.recv(grad, src=rank + 1)
            torch.autograd.backward(outputs[i], grad_tensors=grad)
        if not first:
            dist.send(inputs[i].grad, dst=rank - 1)

    # global grad norm over all stages, every rank takes part
    sq = torch.zeros(1, device=device)
    for p in model.parameters():
        if p.grad is not None:
            sq += p.grad.float().pow(2).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt().item()
    if norm > args.clip:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(args.clip / (norm + 1e-6))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    total = torch.stack(losses).sum().detach() if last else torch.zeros((), device=device)
    return total, norm


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, n_stages = dist.get_rank(), dist.get_world_size()
    assert n_stages >= 2, "need at least two stages"
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    model = Stage(args, rank, n_stages).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, args))
    stream = TokenStream(args.data, args.seq_len, args.seed) if rank == 0 else None

    os.makedirs(args.save_dir, exist_ok=True)
    shard_path = os.path.join(args.save_dir, f"stage{rank:02d}.pt")
    start = 0
    if os.path.exists(shard_path):
        ck = torch.load(shard_path, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optim"])
        scheduler.load_state_dict(ck["sched"])
        start = ck["step"]
        if rank == 0:
            stream.rng = np.random.default_rng(args.seed + start)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[stage {rank}] {len(model.blocks)} blocks, {n_params / 1e6:.1f}M params", flush=True)

    t0 = time.time()
    for step in range(start, args.steps):
        model.train()
        loss, gnorm = train_step(model, optimizer, stream, args, rank, n_stages, device)
        scheduler.step()
        if rank == n_stages - 1 and step % 20 == 0:
            dt = (time.time() - t0) / 20
            t0 = time.time()
            toks = args.micro_batch * args.n_micro * args.seq_len
            print(f"step {step} loss {loss.item():.4f} gnorm {gnorm:.2f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} tok/s {toks / dt:.0f}", flush=True)
        if (step + 1) % args.save_every == 0:
            # each stage writes its own shard
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                        "sched": scheduler.state_dict(), "step": step + 1,
                        "n_stages": n_stages}, shard_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
