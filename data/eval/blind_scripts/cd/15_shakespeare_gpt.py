"""
GPT pretraining with periodic checkpoints, resume, and a best-model export that the
sampling / eval-harness scripts load into a plain GPT().

    torchrun --standalone --nproc_per_node=4 15_shakespeare_gpt.py --out_dir out/shakespeare-char \
        --dataset shakespeare_char --block_size 256 --n_layer 6 --n_head 6 --n_embd 384
    # resume after preemption:
    torchrun --standalone --nproc_per_node=4 15_shakespeare_gpt.py --out_dir out/shakespeare-char \
        --dataset shakespeare_char --block_size 256 --n_layer 6 --n_head 6 --n_embd 384 --init_from resume
"""
import os
import math
import time
import pickle
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(block_size), persistent=False)

    def forward(self, idx, targets=None):
        T = idx.size(1)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)))
        x = self.blocks(x, mask=self.causal[:T, :T], is_causal=True)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out_dir", default="out")
    ap.add_argument("--dataset", default="openwebtext")
    ap.add_argument("--init_from", default="scratch", choices=["scratch", "resume"])
    ap.add_argument("--block_size", type=int, default=1024)
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--n_head", type=int, default=12)
    ap.add_argument("--n_embd", type=int, default=768)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min_lr", type=float, default=1e-4)
    ap.add_argument("--warmup_iters", type=int, default=100)
    ap.add_argument("--max_iters", type=int, default=5000)
    ap.add_argument("--eval_interval", type=int, default=250)
    ap.add_argument("--eval_iters", type=int, default=200)
    ap.add_argument("--ckpt_interval", type=int, default=500)
    return ap.parse_args()


def main():
    a = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}"
    master = rank == 0
    torch.manual_seed(1337 + rank)

    data_dir = os.path.join("data", a.dataset)
    vocab_size = 50304
    meta_path = os.path.join(data_dir, "meta.pkl")
    if os.path.exists(meta_path):
        with open(meta_path, "rb") as f:
            vocab_size = pickle.load(f)["vocab_size"]

    def get_batch(split):
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - a.block_size, (a.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + a.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + a.block_size].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model_args = dict(vocab_size=vocab_size, block_size=a.block_size, n_layer=a.n_layer,
                      n_head=a.n_head, n_embd=a.n_embd, dropout=a.dropout)
    model = GPT(**model_args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.1)

    iter_num, best_val = 0, 1e9
    if a.init_from == "resume":
        ckpt = torch.load(os.path.join(a.out_dir, "ckpt.pt"), map_location=device)
        state_dict = ckpt["model"]
        unwanted_prefix = "_orig_mod."
        for k in list(state_dict.keys()):
            if k.startswith(unwanted_prefix):
                state_dict[k[len(unwanted_prefix):]] = state_dict.pop(k)
        model.load_state_dict(state_dict)
        optimizer.load_state_dict(ckpt["optimizer"])
        iter_num, best_val = ckpt["iter_num"], ckpt["best_val"]
        del ckpt, state_dict

    model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split in ("train", "val"):
            losses = torch.zeros(a.eval_iters, device=device)
            for k in range(a.eval_iters):
                X, Y = get_batch(split)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, losses[k] = model(X, Y)
            m = losses.mean()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            out[split] = m.item()
        model.train()
        return out

    def get_lr(it):
        if it < a.warmup_iters:
            return a.lr * (it + 1) / (a.warmup_iters + 1)
        r = min(1.0, (it - a.warmup_iters) / (a.max_iters - a.warmup_iters))
        return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (a.lr - a.min_lr)

    if master:
        os.makedirs(a.out_dir, exist_ok=True)
    tokens_per_iter = a.batch_size * a.block_size * a.grad_accum * world
    X, Y = get_batch("train")
    t0 = time.time()
    while iter_num <= a.max_iters:
        lr = get_lr(iter_num)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if iter_num % a.eval_interval == 0:
            losses = estimate_loss()
            if master:
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                if losses["val"] < best_val and iter_num > 0:
                    best_val = losses["val"]
                    torch.save({"model": model.module._orig_mod.state_dict(), "model_args": model_args,
                                "iter_num": iter_num, "val_loss": best_val},
                               os.path.join(a.out_dir, "best.pt"))

        if iter_num > 0 and iter_num % a.ckpt_interval == 0 and master:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "model_args": model_args, "iter_num": iter_num, "best_val": best_val},
                       os.path.join(a.out_dir, "ckpt.pt"))

        for micro in range(a.grad_accum):
            model.require_backward_grad_sync = micro == a.grad_accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(X, Y)
                loss = loss / a.grad_accum
            X, Y = get_batch("train")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if iter_num % 10 == 0 and master:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / (10 if iter_num else 1)
            t0 = time.time()
            print(f"iter {iter_num}: loss {loss.item() * a.grad_accum:.4f}, lr {lr:.2e}, "
                  f"{dt*1000:.1f}ms, {tokens_per_iter / dt:,.0f} tok/s")
        iter_num += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
