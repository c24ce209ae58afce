"""1.3B decoder pretraining with FSDP (HYBRID_SHARD: shard inside a node, replicate across nodes).

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    07_fsdp_decoder_1b3.py --data /shared/tok/slimpajama_6b --out /shared/runs/dec1b3
"""
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, d, n_heads, ffn):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.ffn_norm = RMSNorm(d)
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w3 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, D // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, D))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self, vocab=32000, d=2048, layers=24, heads=16, ffn=5632, max_len=2048):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


class Chunks(Dataset):
    def __init__(self, path, seq):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i):
        s = i * self.seq
        buf = torch.from_numpy(self.data[s : s + self.seq + 1].astype(np.int64))
        return buf[:-1], buf[1:]


def save_checkpoint(model, opt, step, path, rank):
    # every rank takes part in gathering; only rank 0 receives the full tensors
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": model_sd, "optim": optim_sd, "step": step}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def load_checkpoint(model, opt, path):
    ck = torch.load(path, map_location="cpu", weights_only=False)
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model.load_state_dict(ck["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ck["optim"]))
    return ck["step"]


@torch.no_grad()
def evaluate(model, loader, device, max_batches=50):
    model.eval()
    acc = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i == max_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        acc[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        acc[1] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-bs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--eval-every", type=int, default=1_000)
    ap.add_argument("--ckpt-every", type=int, default=2_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(0)  # identical init everywhere; sync_module_states also broadcasts rank 0's
    model = Decoder(max_len=args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        limit_all_gathers=True,
        use_orig_params=True,
        sync_module_states=True,
        device_id=device,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, DecoderLayer),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

    train_ds = Chunks(os.path.join(args.data, "train.bin"), args.seq)
    val_ds = Chunks(os.path.join(args.data, "val.bin"), args.seq)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_bs, sampler=val_sampler, num_workers=2,
                        pin_memory=True, drop_last=True)

    ckpt_path = os.path.join(args.out, "ckpt.pt")
    step = load_checkpoint(model, opt, ckpt_path) if os.path.exists(ckpt_path) else 0
    for _ in range(step):
        sched.step()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{n_params / 1e9:.2f}B params on {world} GPUs, start step {step}", flush=True)

    tokens_per_step = args.micro_bs * args.seq * world
    flops_per_step = 6 * n_params * tokens_per_step
    epoch = step * args.micro_bs // max(1, len(sampler))
    t0 = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / 20
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    mfu = flops_per_step / dt / (world * 989e12)
                    print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.2f} "
                          f"{tokens_per_step / dt / 1e3:.0f}k tok/s mfu {mfu:.1%}", flush=True)
                t0 = time.perf_counter()
            if step % args.eval_every == 0:
                vl = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f}", flush=True)
            if step % args.ckpt_every == 0:
                save_checkpoint(model, opt, step, ckpt_path, rank)
                t0 = time.perf_counter()
            if step >= args.steps:
                break
        epoch += 1

    save_checkpoint(model, opt, step, ckpt_path, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
