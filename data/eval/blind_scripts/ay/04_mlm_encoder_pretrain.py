# MLM pretraining of a 24-layer encoder (BERT-large shape) with selective activation checkpointing.
#
#   torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node0:29500 \
#       04_mlm_encoder_pretrain.py --config configs/bert_large.yaml
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    data="/shared/data/mlm_tokens_512.npy",
    out="/shared/runs/bert_large_mlm",
    vocab=32768, dim=1024, layers=24, heads=16, seq=512,
    micro_bs=32, steps=100_000, warmup=2_000, lr=4e-4, wd=0.01,
    ckpt_every=2, mask_prob=0.15, mask_id=4, pad_id=0,
    log_every=50, save_every=5_000, find_unused=True, workers=6,
)


class TokenBlocks(Dataset):
    def __init__(self, path, seq):
        self.arr = np.load(path, mmap_mode="r")
        self.seq = seq
        assert self.arr.shape[1] == seq

    def __len__(self):
        return self.arr.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(self.arr[i].astype(np.int64))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x, attn_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=attn_mask)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x


class MLMEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c["vocab"], c["dim"])
        self.pos = nn.Parameter(torch.zeros(1, c["seq"], c["dim"]))
        self.layers = nn.ModuleList(EncoderLayer(c["dim"], c["heads"]) for _ in range(c["layers"]))
        self.norm = nn.LayerNorm(c["dim"])
        self.head = nn.Linear(c["dim"], c["vocab"])
        self.ckpt_every = c["ckpt_every"]
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids):
        pad = ids.eq(0)
        attn_mask = (~pad)[:, None, None, :]
        x = self.tok(ids) + self.pos[:, : ids.size(1)]
        for i, layer in enumerate(self.layers):
            if self.training and self.ckpt_every and i % self.ckpt_every == 0:
                x = checkpoint(layer, x, attn_mask, use_reentrant=True)
            else:
                x = layer(x, attn_mask)
        return self.head(self.norm(x))


def mask_tokens(ids, c, gen):
    labels = ids.clone()
    prob = torch.full(ids.shape, c["mask_prob"], device=ids.device)
    prob.masked_fill_(ids.eq(c["pad_id"]), 0.0)
    masked = torch.bernoulli(prob, generator=gen).bool()
    labels[~masked] = -100
    r = torch.rand(ids.shape, device=ids.device, generator=gen)
    inputs = ids.clone()
    inputs[masked & (r < 0.8)] = c["mask_id"]
    rand_sel = masked & (r >= 0.8) & (r < 0.9)
    inputs[rand_sel] = torch.randint(5, c["vocab"], (int(rand_sel.sum()),), device=ids.device, generator=gen)
    return inputs, labels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    c = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            c.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    ds = TokenBlocks(c["data"], c["seq"])
    sampler = DistributedSampler(ds, shuffle=True, seed=17, drop_last=True)
    dl = DataLoader(ds, batch_size=c["micro_bs"], sampler=sampler, num_workers=c["workers"],
                    pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    torch.manual_seed(0)
    model = MLMEncoder(c).to(dev)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=c["find_unused"],
                bucket_cap_mb=64, gradient_as_bucket_view=True)
    n_params = sum(p.numel() for p in model.parameters())

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "pos" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c["wd"]}, {"params": other, "weight_decay": 0.0}],
                            lr=c["lr"], betas=(0.9, 0.98), eps=1e-6, fused=True)

    def lr_at(s):
        if s < c["warmup"]:
            return c["lr"] * s / c["warmup"]
        return c["lr"] * max(0.0, (c["steps"] - s) / (c["steps"] - c["warmup"]))

    step, epoch = 0, 0
    ckpt_path = os.path.join(c["out"], "latest.pt")
    if os.path.exists(ckpt_path):
        sd = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        step, epoch = sd["step"], sd["epoch"]
    if rank == 0:
        os.makedirs(c["out"], exist_ok=True)
        print(f"{n_params / 1e6:.1f}M params, world {world}, global batch {c['micro_bs'] * world}")

    gen = torch.Generator(device=dev)
    gen.manual_seed(1234 + rank)
    t_start, t_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    loss_sum = torch.zeros(2, device=dev)
    model.train()
    t_start.record()
    while step < c["steps"]:
        sampler.set_epoch(epoch)
        for ids in dl:
            ids = ids.to(dev, non_blocking=True)
            inputs, labels = mask_tokens(ids, c, gen)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inputs)
            loss = F.cross_entropy(logits.float().view(-1, c["vocab"]), labels.view(-1), ignore_index=-100)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            n_masked = labels.ne(-100).sum()
            loss_sum += torch.stack([loss.detach() * n_masked, n_masked.float()])

            if step % c["log_every"] == 0:
                t_end.record()
                t_end.synchronize()
                dt = t_start.elapsed_time(t_end) / 1000 / c["log_every"]
                dist.all_reduce(loss_sum)
                if rank == 0:
                    seq_s = c["micro_bs"] * world / dt
                    print(f"step {step} mlm_loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                          f"gnorm {gnorm.item():.2f} {dt * 1e3:.0f} ms/it {seq_s:.0f} seq/s")
                loss_sum.zero_()
                t_start.record()

            if step % c["save_every"] == 0:
                if rank == 0:
                    tmp = ckpt_path + ".tmp"
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "step": step, "epoch": epoch, "config": c}, tmp)
                    os.replace(tmp, ckpt_path)
                dist.barrier()
            if step >= c["steps"]:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
