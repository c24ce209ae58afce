# Megatron-lite style pretraining: fixed-length packed samples, DataLoader + DistributedSampler,
# activation checkpointing, bf16 autocast, compile, cosine schedule in iterations.
#
#   torchrun --standalone --nproc_per_node=8 07_megatron_lite_loader.py \
#       --data-prefix /datasets/c4_en/c4_en_text_document --save ckpt/c4-760m
import os
import math
import time
import argparse
import itertools

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset, DataLoader, DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-prefix", required=True)
    p.add_argument("--save", default="ckpt/run")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=1536)
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--min-lr", type=float, default=2.5e-5)
    p.add_argument("--lr-warmup-iters", type=int, default=2000)
    p.add_argument("--train-iters", type=int, default=60000)
    p.add_argument("--eval-interval", type=int, default=1000)
    p.add_argument("--eval-iters", type=int, default=50)
    p.add_argument("--save-interval", type=int, default=2000)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class PackedDataset(Dataset):
    """Non-overlapping (seq_len + 1)-token samples cut out of a flat token file."""

    def __init__(self, prefix, split, seq_len):
        self.path = f"{prefix}_{split}.bin"
        self.seq_len = seq_len
        self.index = np.load(f"{prefix}_{split}_{seq_len}_idx.npy", mmap_mode="r")
        self.data = None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        if self.data is None:  # opened lazily in each worker
            self.data = np.memmap(self.path, dtype=np.uint16, mode="r")
        s = int(self.index[i])
        return torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))


def build_index(prefix, split, seq_len):
    out = f"{prefix}_{split}_{seq_len}_idx.npy"
    if os.path.exists(out):
        return
    n = len(np.memmap(f"{prefix}_{split}.bin", dtype=np.uint16, mode="r"))
    starts = np.arange(0, n - seq_len - 1, seq_len, dtype=np.int64)
    tmp = out + f".tmp{os.getpid()}.npy"
    np.save(tmp, starts)
    os.replace(tmp, out)


class Layer(nn.Module):
    def __init__(self, h, nh):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.dense = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.nh = nh

    def forward(self, x):
        B, T, H = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.nh, H // self.nh).permute(2, 0, 3, 1, 4)
        x = x + self.dense(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, H))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTModel(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.recompute = a.recompute
        self.word_emb = nn.Embedding(a.vocab_size, a.hidden_size)
        self.pos_emb = nn.Embedding(a.seq_length, a.hidden_size)
        self.layers = nn.ModuleList(Layer(a.hidden_size, a.num_heads) for _ in range(a.num_layers))
        self.final_ln = nn.LayerNorm(a.hidden_size)
        for n, p in self.named_parameters():
            if n.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif n.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens):
        x = self.word_emb(tokens) + self.pos_emb(torch.arange(tokens.size(1), device=tokens.device))
        for layer in self.layers:
            if self.recompute and self.training:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        # output layer shares the input embedding
        return F.linear(self.final_ln(x), self.word_emb.weight)


def lr_at(it, a):
    if it < a.lr_warmup_iters:
        return a.lr * it / a.lr_warmup_iters
    frac = min(1.0, (it - a.lr_warmup_iters) / (a.train_iters - a.lr_warmup_iters))
    return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    if rank == 0:
        for split in ("train", "valid"):
            build_index(a.data_prefix, split, a.seq_length)
    dist.barrier()

    assert a.global_batch_size % (a.micro_batch_size * world) == 0
    accum = a.global_batch_size // (a.micro_batch_size * world)

    train_ds = PackedDataset(a.data_prefix, "train", a.seq_length)
    valid_ds = PackedDataset(a.data_prefix, "valid", a.seq_length)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=a.seed, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.micro_batch_size, sampler=train_sampler, drop_last=True,
                          num_workers=a.num_workers, pin_memory=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, batch_size=a.micro_batch_size, sampler=valid_sampler, drop_last=True,
                          num_workers=2, pin_memory=True)
    eval_iters = min(a.eval_iters, len(valid_dl))

    torch.manual_seed(a.seed)
    model = GPTModel(a).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    it, epoch, skip = 0, 0, 0
    ckpt_file = os.path.join(a.save, "latest.pt")
    if os.path.exists(ckpt_file):
        sd = torch.load(ckpt_file, map_location="cpu")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        it, epoch, skip = sd["iteration"], sd["epoch"], sd["batches_in_epoch"]
        if sd["world_size"] != world:
            # per-rank batch positions mean nothing under another world size: start the next epoch
            epoch, skip = epoch + 1, 0
        if rank == 0:
            print(f"resumed from iteration {it} (epoch {epoch})")
        del sd

    n_params = sum(p.numel() for p in model.parameters())
    model = DDP(torch.compile(model), device_ids=[local_rank])

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot = torch.zeros(2, device=dev)
        for batch in itertools.islice(valid_dl, eval_iters):
            batch = batch.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
            tot[0] += F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            tot[1] += batch[:, 1:].numel()
        dist.all_reduce(tot)
        model.train()
        return (tot[0] / tot[1]).item()

    def batches():
        nonlocal epoch, skip
        while True:
            train_sampler.set_epoch(epoch)
            for i, b in enumerate(train_dl):
                if i < skip:
                    continue
                yield i, b
            skip = 0
            epoch += 1

    stream = batches()
    tokens_per_iter = a.global_batch_size * a.seq_length
    t0 = time.time()
    while it < a.train_iters:
        lr = lr_at(it, a)
        for g in opt.param_groups:
            g["lr"] = lr
        for m in range(accum):
            pos, batch = next(stream)
            batch = batch.to(dev, non_blocking=True)
            ctx = model.no_sync() if m < accum - 1 else torch.enable_grad()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()) / accum
            loss.backward()
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1

        if it % 10 == 0:
            lt = loss.detach() * accum
            dist.all_reduce(lt, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            dt = (time.time() - t0) / 10
            t0 = time.time()
            if rank == 0:
                tflops = 6 * n_params * tokens_per_iter / dt / world / 1e12
                print(f"it {it} | epoch {epoch} | loss {lt.item():.4f} | lr {lr:.3e} | gnorm {gnorm:.2f} | "
                      f"{tokens_per_iter / dt:,.0f} tok/s | {tflops:.0f} TFLOP/s/gpu")

        if it % a.eval_interval == 0:
            vl = evaluate()
            if rank == 0:
                print(f"it {it} | valid loss {vl:.4f} | valid ppl {math.exp(min(vl, 20)):.2f}")

        if it % a.save_interval == 0 or it == a.train_iters:
            if rank == 0:
                os.makedirs(a.save, exist_ok=True)
                torch.save({"model": model.module._orig_mod.state_dict(), "optimizer": opt.state_dict(),
                            "iteration": it, "epoch": epoch, "batches_in_epoch": pos + 1,
                            "world_size": world}, ckpt_file + ".tmp")
                os.replace(ckpt_file + ".tmp", ckpt_file)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
