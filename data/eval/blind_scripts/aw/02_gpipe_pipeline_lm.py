"""GPipe-style pipeline-parallel training of a decoder-only LM.

The transformer is cut into world_size stages, one per GPU. Every global batch
is split into micro-batches; all forwards run first, then all backwards, and
activations / gradients move between neighbouring stages with batched
isend / irecv.

    torchrun --nproc_per_node=4 02_gpipe_pipeline_lm.py --data /data/wiki/train.bin
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
from torch.utils.data import DataLoader, Dataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val-data", default=None)
    p.add_argument("--ckpt-dir", default="ckpt/pipeline")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-layers", type=int, default=24)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class PackedTokens(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        buf = torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))
        return buf[:-1], buf[1:]


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.norm2(x))


class Stage(nn.Module):
    def __init__(self, args, stage_id, num_stages):
        super().__init__()
        self.first = stage_id == 0
        self.last = stage_id == num_stages - 1
        per_stage = args.n_layers // num_stages
        if self.first:
            self.tok = nn.Embedding(args.vocab_size, args.d_model)
            self.pos = nn.Embedding(args.seq_len, args.d_model)
        self.layers = nn.ModuleList([DecoderLayer(args.d_model, args.n_heads) for _ in range(per_stage)])
        if self.last:
            self.norm = nn.LayerNorm(args.d_model)
            self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))
        for layer in self.layers:
            x = layer(x)
        if self.last:
            x = self.lm_head(self.norm(x))
        return x


def p2p(op, tensor, peer):
    reqs = dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)])
    for r in reqs:
        r.wait()


def run_pipeline(stage, x, y, args, rank, world, device, act_dtype, train=True):
    """Runs one global batch through the pipeline. Returns the mean loss on the last stage."""
    n_micro = x.size(0) // args.micro_batch
    act_shape = (args.micro_batch, args.seq_len, args.d_model)
    inputs, outputs, losses = [], [], []

    for m in range(n_micro):
        sl = slice(m * args.micro_batch, (m + 1) * args.micro_batch)
        if stage.first:
            inp = x[sl].to(device, non_blocking=True)
        else:
            inp = torch.empty(act_shape, dtype=act_dtype, device=device)
            p2p(dist.irecv, inp, rank - 1)
            inp.requires_grad_(train)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = stage(inp)
        if stage.last:
            loss = F.cross_entropy(out.float().flatten(0, 1), y[sl].to(device).flatten()) / n_micro
            losses.append(loss)
        else:
            out = out.to(act_dtype)
            p2p(dist.isend, out.detach().contiguous(), rank + 1)
        inputs.append(inp)
        outputs.append(out)

    if train:
        for m in reversed(range(n_micro)):
            if stage.last:
                losses[m].backward()
            else:
                grad = torch.empty(act_shape, dtype=act_dtype, device=device)
                p2p(dist.irecv, grad, rank + 1)
                torch.autograd.backward(outputs[m], grad)
            if not stage.first:
                p2p(dist.isend, inputs[m].grad.contiguous(), rank - 1)

    loss_val = torch.zeros(1, device=device)
    if stage.last:
        loss_val += sum(l.detach() for l in losses)
    # every stage takes part so all ranks can log the same number
    dist.broadcast(loss_val, src=world - 1)
    return loss_val.item()


def clip_grad_norm_pipeline(params, max_norm, device):
    sq = torch.zeros(1, device=device)
    for p in params:
        if p.grad is not None:
            sq += p.grad.detach().float().pow(2).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
    return norm.item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    assert args.n_layers % world == 0 and args.global_batch % args.micro_batch == 0
    act_dtype = torch.bfloat16

    torch.manual_seed(args.seed + rank)
    stage = Stage(args, rank, world).to(device)
    n_params = sum(p.numel() for p in stage.parameters())
    print(f"[rank {rank}] stage {rank}/{world}: {len(stage.layers)} layers, {n_params / 1e6:.1f}M params", flush=True)

    # Pure pipeline parallelism: every stage must walk the same batches in the
    # same order, so all ranks share one seeded generator and no sampler.
    gen = torch.Generator()
    gen.manual_seed(args.seed)
    train_ds = PackedTokens(args.data, args.seq_len)
    loader = DataLoader(train_ds, batch_size=args.global_batch, shuffle=True, generator=gen,
                        num_workers=2, pin_memory=True, drop_last=True)
    val_loader = None
    if args.val_data:
        val_loader = DataLoader(PackedTokens(args.val_data, args.seq_len), batch_size=args.global_batch,
                                shuffle=False, num_workers=2, drop_last=True)

    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps,
                                                    pct_start=0.05, anneal_strategy="cos")

    os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt_path = os.path.join(args.ckpt_dir, f"stage{rank:02d}.pt")
    start_epoch = 0
    if args.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        assert state["num_stages"] == world, "checkpoint was written with a different pipeline depth"
        stage.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1
        gen.manual_seed(args.seed + start_epoch)

    step = 0
    for epoch in range(start_epoch, args.epochs):
        stage.train()
        t0 = time.time()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = run_pipeline(stage, x, y, args, rank, world, device, act_dtype, train=True)
            gnorm = clip_grad_norm_pipeline(list(stage.parameters()), args.clip, device)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % args.log_every == 0:
                tok_s = args.log_every * args.global_batch * args.seq_len / (time.time() - t0)
                print(f"epoch {epoch} step {step} loss {loss:.4f} gnorm {gnorm:.2f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} tok/s {tok_s:.0f}", flush=True)
                t0 = time.time()

        if val_loader is not None:
            stage.eval()
            total, count = 0.0, 0
            with torch.no_grad():
                for x, y in val_loader:
                    total += run_pipeline(stage, x, y, args, rank, world, device, act_dtype, train=False)
                    count += 1
            if rank == 0:
                print(f"epoch {epoch} val loss {total / max(count, 1):.4f}", flush=True)

        torch.save({"model": stage.state_dict(), "optim": optimizer.state_dict(),
                    "sched": scheduler.state_dict(), "epoch": epoch, "num_stages": world}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
