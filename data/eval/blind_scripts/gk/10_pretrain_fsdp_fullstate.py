# Small LLaMA-style pretraining with FSDP (FULL_SHARD, bf16 params, fp32 reduce).
# Checkpoints are consolidated full state dicts so they load into a plain nn.Module.
#
#   torchrun --standalone --nproc_per_node=8 pretrain_fsdp.py --out_dir out/tinyllama-120m
#   torchrun --standalone --nproc_per_node=8 pretrain_fsdp.py --out_dir out/tinyllama-120m --resume
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.tensorboard import SummaryWriter


class Attention(nn.Module):
    def __init__(self, dim, n_head, n_kv_head):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, dim // n_head
        self.wq = nn.Linear(dim, n_head * self.hd, bias=False)
        self.wk = nn.Linear(dim, n_kv_head * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_head * self.hd, bias=False)
        self.wo = nn.Linear(n_head * self.hd, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, dim, n_head, n_kv_head, ffn):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attn = Attention(dim, n_head, n_kv_head)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab_size=32000, dim=768, n_layer=12, n_head=12, n_kv_head=4, ffn=2048, max_len=2048):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, n_head, n_kv_head, ffn) for _ in range(n_layer))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        hd = dim // n_head
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def random_windows(data, rng, batch_size, block_size, device):
    ix = rng.integers(0, len(data) - block_size - 1, size=batch_size)
    chunk = np.stack([data[i: i + block_size + 1] for i in ix]).astype(np.int64)
    chunk = torch.from_numpy(chunk).pin_memory().to(device, non_blocking=True)
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model, val_data, block_size, batch_size, eval_tokens, rank, world_size, device):
    model.eval()
    per_step = batch_size * block_size * world_size
    steps = eval_tokens // per_step
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for s in range(steps):
        base = (s * world_size + rank) * batch_size * block_size
        rows = [val_data[base + j * block_size: base + (j + 1) * block_size + 1] for j in range(batch_size)]
        chunk = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(chunk[:, :-1])
        totals[0] += F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").double()
        totals[1] += chunk[:, 1:].numel()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    return (totals[0] / totals[1]).item()


def save_full_checkpoint(model, optimizer, step, path, rank):
    # every rank has to take part in gathering the full state; only rank 0 receives it
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": model_state, "optimizer": optim_state, "step": step}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_bin", default="data/tinystories_llama/train.bin")
    ap.add_argument("--val_bin", default="data/tinystories_llama/val.bin")
    ap.add_argument("--out_dir", default="out/tinyllama-120m")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--block_size", type=int, default=1024)
    ap.add_argument("--micro_batch", type=int, default=16)
    ap.add_argument("--global_batch", type=int, default=512)
    ap.add_argument("--max_steps", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--eval_tokens", type=int, default=2 * 2**20)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    master = rank == 0

    assert args.global_batch % (args.micro_batch * world_size) == 0
    accum = args.global_batch // (args.micro_batch * world_size)
    ckpt_path = os.path.join(args.out_dir, "last.pt")

    torch.manual_seed(args.seed)
    model = TinyLlama(max_len=args.block_size)
    start_step = 0
    ckpt = None
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        start_step = ckpt["step"]

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        device_id=device,
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if ckpt is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False), FullOptimStateDictConfig(rank0_only=False)):
            osd = FSDP.optim_state_dict_to_load(model, optimizer, ckpt["optimizer"])
        optimizer.load_state_dict(osd)
        del ckpt, osd

    # each rank draws its own random windows; the seed offset keeps the streams distinct
    rng = np.random.default_rng(args.seed + 1000 * start_step + rank)
    train_data = np.memmap(args.train_bin, dtype=np.uint16, mode="r")
    val_data = np.memmap(args.val_bin, dtype=np.uint16, mode="r")

    writer = None
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out_dir, "tb"))

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        prog = (step - args.warmup) / max(1, args.max_steps - args.warmup)
        return 0.1 * args.lr + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0)))

    t0 = time.time()
    for step in range(start_step, args.max_steps + 1):
        if step % args.eval_every == 0 or step == args.max_steps:
            vl = evaluate(model, val_data, args.block_size, args.micro_batch, args.eval_tokens, rank, world_size, device)
            if master:
                print(f"step {step}: val loss {vl:.4f}")
                writer.add_scalar("val/loss", vl, step)
        if step > start_step and (step % args.save_every == 0 or step == args.max_steps):
            save_full_checkpoint(model, optimizer, step, ckpt_path, rank)
        if step == args.max_steps:
            break

        for g in optimizer.param_groups:
            g["lr"] = lr_at(step)
        running = torch.zeros((), device=device)
        for _ in range(accum):
            x, y = random_windows(train_data, rng, args.micro_batch, args.block_size, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / accum
            loss.backward()
            running += loss.detach()
        gnorm = model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % 20 == 0:
            dist.all_reduce(running, op=dist.ReduceOp.AVG)
            if master:
                dt = (time.time() - t0) / 20
                t0 = time.time()
                print(f"step {step}: loss {running.item():.4f} gnorm {gnorm.item():.3f} {dt * 1000:.0f}ms/step")
                writer.add_scalar("train/loss", running.item(), step)
                writer.add_scalar("train/lr", lr_at(step), step)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
