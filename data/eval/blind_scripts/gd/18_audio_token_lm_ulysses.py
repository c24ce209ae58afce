"""Long-form audio LM over codec tokens (8 codebooks flattened, ~10 min per sample = 240k tokens).

Ulysses sequence parallelism inside SP groups of consecutive ranks, data parallel
across them.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER:29500 \
        18_audio_token_lm_ulysses.py --shards /data/shared/codec_tokens --sp 8
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

N_CODEBOOKS = 8
CODEBOOK_SIZE = 1024
VOCAB = N_CODEBOOKS * CODEBOOK_SIZE + 2  # + BOS / EOS
BOS = VOCAB - 2


def make_sp_group(sp):
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % sp == 0
    sp_group = None
    for i in range(world // sp):
        r = list(range(i * sp, (i + 1) * sp))
        g = dist.new_group(r)
        if rank in r:
            sp_group = g
    return sp_group


class UlyssesA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sdim, gdim):
        ctx.group, ctx.sdim, ctx.gdim = group, sdim, gdim
        n = dist.get_world_size(group)
        xs = [c.contiguous() for c in x.chunk(n, sdim)]
        out = [torch.empty_like(xs[0]) for _ in range(n)]
        dist.all_to_all(out, xs, group=group)
        return torch.cat(out, gdim)

    @staticmethod
    def backward(ctx, g):
        return UlyssesA2A.apply(g, ctx.group, ctx.gdim, ctx.sdim), None, None, None


class Block(nn.Module):
    def __init__(self, dim, heads, group):
        super().__init__()
        self.heads, self.group = heads, group
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x, cos, sin):
        B, S, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, C // self.heads)
        q, k, v = qkv.unbind(2)
        q = q * cos + torch.cat([-q[..., q.size(-1) // 2:], q[..., : q.size(-1) // 2]], -1) * sin
        k = k * cos + torch.cat([-k[..., k.size(-1) // 2:], k[..., : k.size(-1) // 2]], -1) * sin
        qkv = torch.stack([q.to(v.dtype), k.to(v.dtype), v], 2)
        qkv = UlyssesA2A.apply(qkv, self.group, 3, 1)  # scatter heads, gather sequence
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        a = UlyssesA2A.apply(a, self.group, 1, 2).reshape(B, S, C)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class AudioLM(nn.Module):
    def __init__(self, dim, depth, heads, group):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, group) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids, cos, sin):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.ln(x))


class CodecShards(Dataset):
    """Each .npy is [T, 8] codes of one recording; flattened frame-major with per-codebook offsets."""

    def __init__(self, root, seq_len):
        self.files = sorted(glob.glob(os.path.join(root, "*.npy")))
        self.seq_len = seq_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        codes = np.load(self.files[i], mmap_mode="r")
        n_frames = (self.seq_len) // N_CODEBOOKS
        codes = np.asarray(codes[:n_frames], dtype=np.int64)
        if len(codes) < n_frames:
            codes = np.pad(codes, ((0, n_frames - len(codes)), (0, 0)), constant_values=-1)
        flat = codes + np.arange(N_CODEBOOKS)[None] * CODEBOOK_SIZE
        flat[codes < 0] = -100
        flat = flat.reshape(-1)
        ids = np.concatenate([[BOS], flat])
        inp = np.where(ids[:-1] < 0, BOS, ids[:-1])
        return torch.from_numpy(inp), torch.from_numpy(ids[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--logdir", default="/data/shared/runs/audio_lm")
    ap.add_argument("--sp", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=245760)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--max-steps", type=int, default=50000)
    ap.add_argument("--log-interval", type=int, default=20)
    ap.add_argument("--ckpt-interval", type=int, default=2000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    sp_group = make_sp_group(args.sp)
    sp_rank, dp_rank, dp_size = rank % args.sp, rank // args.sp, world // args.sp
    L = args.seq_len // args.sp

    torch.manual_seed(0)
    model = DDP(AudioLM(args.dim, args.depth, args.heads, sp_group).cuda(), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.max_steps) / args.max_steps)))

    hd = args.dim // args.heads
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, device="cuda").float() / hd)
    ang = torch.outer(torch.arange(sp_rank * L, (sp_rank + 1) * L, device="cuda").float(), inv)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]

    ds = CodecShards(args.shards, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    step, epoch = 0, 0
    tic = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for inp, tgt in loader:
            inp = inp[:, sp_rank * L:(sp_rank + 1) * L].cuda(non_blocking=True)
            tgt = tgt[:, sp_rank * L:(sp_rank + 1) * L].cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, cos, sin)
            # short recordings are padded, so a shard can have few (or no) targets:
            # normalise by the target count of the whole sample
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="sum")
            n_tgt = (tgt != -100).sum().float()
            dist.all_reduce(n_tgt, group=sp_group)
            loss = loss_sum / n_tgt.clamp(min=1.0) * args.sp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % args.log_interval == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg)
                loss_avg /= world
                elapsed = time.time() - tic
                writer.add_scalar("loss/train", loss_avg.item(), step)
                writer.add_scalar("grad_norm", gn.item(), step)
                writer.add_scalar("lr", sched.get_last_lr()[0], step)
                writer.add_scalar("tokens_per_sec", args.log_interval * dp_size * args.seq_len / elapsed, step)
                print(f"step {step} loss {loss_avg.item():.4f} ({elapsed / args.log_interval:.2f}s/it)", flush=True)
                tic = time.time()

            if step % args.ckpt_interval == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(args.logdir, f"ckpt_{step:06d}.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
