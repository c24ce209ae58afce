"""LlamaGen-style autoregressive image generator (GPT-XL, 775M) over VQ f16 tokens, FSDP full shard.

    srun --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 bash -c 'torchrun --nnodes=4 --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 \
        17_gpt_fsdp_large.py --code_path /lustre/tok/imagenet256_vq16 --results /lustre/runs/gpt_xl'
"""
import argparse
import functools
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CodeFolder(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "codes", "*.npy")))
        self.labels = np.load(os.path.join(root, "labels.npy"))
        assert len(self.files) == len(self.labels)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        codes = np.load(self.files[i])              # (2, 256): original + hflip augmentation
        codes = codes[np.random.randint(2)]
        return torch.from_numpy(codes.astype(np.int64)), int(self.labels[i])


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        hidden = int(2 * 4 * d / 3)
        hidden = 256 * ((hidden + 255) // 256)
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, self.h, d // self.h).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ImageTransformer(nn.Module):
    def __init__(self, vocab=16384, n_cls=1000, block=256, d=1280, L=36, H=20, class_dropout=0.1):
        super().__init__()
        self.n_cls, self.class_dropout = n_cls, class_dropout
        self.cls_emb = nn.Embedding(n_cls + 1, d)
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, block, d))
        self.layers = nn.ModuleList([DecoderLayer(d, H) for _ in range(L)])
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, codes, y):
        if self.training:
            y = torch.where(torch.rand_like(y, dtype=torch.float) < self.class_dropout,
                            torch.full_like(y, self.n_cls), y)
        x = torch.cat([self.cls_emb(y)[:, None], self.tok_emb(codes[:, :-1])], 1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--code_path", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--ckpt_every", type=int, default=10_000)
    ap.add_argument("--log_every", type=int, default=100)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    assert args.global_batch % world == 0
    bs = args.global_batch // world

    model = ImageTransformer()
    if rank == 0:
        print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M", flush=True)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=device,
        limit_all_gathers=True,
        sync_module_states=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.95))

    ds = CodeFolder(args.code_path)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    ckpt_dir = os.path.join(args.results, "checkpoints")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    step = 0
    running, t0 = torch.zeros(1, device=device), time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for codes, y in dl:
            codes, y = codes.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(codes, y)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), codes.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            running += loss.detach()
            step += 1

            if step % args.log_every == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"(step={step:07d}) loss {running.item() / (args.log_every * world):.4f} "
                          f"{args.log_every / (time.time() - t0):.2f} it/s", flush=True)
                running.zero_()
                t0 = time.time()

            if step % args.ckpt_every == 0:
                if rank == 0:
                    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                        state = model.state_dict()
                    torch.save({"model": state, "steps": step, "args": vars(args)},
                               os.path.join(ckpt_dir, f"{step:07d}.pt"))
                    print(f"saved checkpoint at step {step}", flush=True)
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
