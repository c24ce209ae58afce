"""
Pretraining script for the 350M baseline, logs to Weights & Biases.

    export WANDB_PROJECT=lm-pretrain
    torchrun --standalone --nproc_per_node=8 09_gpt350m_slimpajama.py --run_name gpt350m-bs512k
"""
import os
import math
import time
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run_name", default="gpt350m")
    ap.add_argument("--data_dir", default="/data/slimpajama_6b")
    ap.add_argument("--ckpt_dir", default="/checkpoints")
    ap.add_argument("--n_layer", type=int, default=24)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--n_embd", type=int, default=1024)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--micro_bs", type=int, default=8)
    ap.add_argument("--grad_accum", type=int, default=64, help="total over all ranks")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup_iters", type=int, default=2000)
    ap.add_argument("--max_iters", type=int, default=100000)
    ap.add_argument("--eval_interval", type=int, default=1000)
    ap.add_argument("--eval_iters", type=int, default=100)
    ap.add_argument("--log_interval", type=int, default=10)
    ap.add_argument("--no_compile", action="store_true")
    return ap.parse_args()


class Block(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh = nh
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.c_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, -1).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, seq_len, vocab=50304):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("c_out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    master = rank == 0

    assert args.grad_accum % world == 0
    accum = args.grad_accum // world
    tokens_per_iter = args.grad_accum * args.micro_bs * args.seq_len

    wandb.init(project=os.environ.get("WANDB_PROJECT", "lm-pretrain"), name=args.run_name,
               config={**vars(args), "world_size": world, "tokens_per_iter": tokens_per_iter})

    torch.manual_seed(1337 + rank)
    train_bin = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_bin = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint16, mode="r")

    def get_batch(data):
        ix = torch.randint(len(data) - args.seq_len - 1, (args.micro_bs,))
        x = torch.stack([torch.from_numpy(data[i:i + args.seq_len].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.seq_len].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model = GPT(args.n_layer, args.n_head, args.n_embd, args.seq_len).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True)

    ckpt_dir = os.path.join(args.ckpt_dir, args.run_name)
    ckpt_path = os.path.join(ckpt_dir, "ckpt.pt")
    iter_num, best_val = 0, float("inf")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        iter_num, best_val = ck["iter_num"], ck["best_val"]
        del ck

    raw = model
    if not args.no_compile:
        model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    def get_lr(it):
        min_lr = args.lr / 10
        if it < args.warmup_iters:
            return args.lr * (it + 1) / (args.warmup_iters + 1)
        ratio = min(1.0, (it - args.warmup_iters) / (args.max_iters - args.warmup_iters))
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - min_lr)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split, data in (("train", train_bin), ("val", val_bin)):
            losses = torch.zeros(args.eval_iters, device=device)
            for k in range(args.eval_iters):
                X, Y = get_batch(data)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    losses[k] = model(X, Y)
            m = losses.mean()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            out[split] = m.item()
        model.train()
        return out

    X, Y = get_batch(train_bin)
    t0 = time.time()
    while iter_num <= args.max_iters:
        lr = get_lr(iter_num)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            if master:
                print(f"iter {iter_num}: train {losses['train']:.4f} val {losses['val']:.4f}")
                wandb.log({"iter": iter_num, "eval/train_loss": losses["train"],
                           "eval/val_loss": losses["val"], "lr": lr}, step=iter_num)
                if losses["val"] < best_val and iter_num > 0:
                    best_val = losses["val"]
                    os.makedirs(ckpt_dir, exist_ok=True)
                    torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                                "iter_num": iter_num, "best_val": best_val, "args": vars(args)}, ckpt_path)

        for micro_step in range(accum):
            model.require_backward_grad_sync = micro_step == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(X, Y) / accum
            X, Y = get_batch(train_bin)
            loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if master and iter_num % args.log_interval == 0:
            lossf = loss.item() * accum
            tok_s = tokens_per_iter / dt
            mfu = 6 * n_params * tok_s / (world * 989e12)
            print(f"iter {iter_num}: loss {lossf:.4f} {dt*1000:.0f}ms {tok_s:,.0f} tok/s mfu {mfu*100:.1f}%")
            wandb.log({"train/loss": lossf, "lr": lr, "grad_norm": gnorm.item(),
                       "perf/tok_per_s": tok_s, "perf/mfu": mfu}, step=iter_num)
        iter_num += 1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
