"""
Pretrain a small GPT (124M) on a pre-tokenized corpus (train.bin / val.bin, uint16 GPT-2 tokens).

Single GPU:   python 17_gpt_pretrain_compile.py
Multi GPU:    torchrun --standalone --nproc_per_node=8 17_gpt_pretrain_compile.py
"""
import argparse
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        x = x + self.fc_out(F.gelu(self.fc(self.ln2(x))))
        return x


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/openwebtext")
    p.add_argument("--out_dir", default="out-gpt124m")
    p.add_argument("--batch_size", type=int, default=12, help="micro batch per GPU")
    p.add_argument("--total_batch_tokens", type=int, default=491520, help="tokens per optimizer step, all GPUs")
    p.add_argument("--max_iters", type=int, default=600000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--warmup_iters", type=int, default=2000)
    p.add_argument("--eval_interval", type=int, default=2000)
    p.add_argument("--eval_iters", type=int, default=200)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


def main():
    args = get_args()
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = f"cuda:{local_rank}"
    else:
        rank, world, local_rank, device = 0, 1, 0, "cuda"
    master = rank == 0
    torch.manual_seed(1337 + rank)  # different batches per rank; DDP syncs the initial weights
    torch.backends.cuda.matmul.allow_tf32 = True

    cfg = GPTConfig()
    T = cfg.block_size
    assert args.total_batch_tokens % (args.batch_size * T * world) == 0
    grad_accum = args.total_batch_tokens // (args.batch_size * T * world)
    if master:
        print(f"world {world}, grad accum {grad_accum}, {args.total_batch_tokens} tokens/iter")
        os.makedirs(args.out_dir, exist_ok=True)

    def get_batch(split):
        data = np.memmap(os.path.join(args.data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - T, (args.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=True)
    iter_num, best_val = 0, 1e9
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        iter_num, best_val = ckpt["iter_num"], ckpt["best_val"]
        del ckpt

    raw_model = model
    if not args.no_compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[local_rank])

    def lr_at(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / args.warmup_iters
        ratio = min(1.0, (it - args.warmup_iters) / (args.max_iters - args.warmup_iters))
        return args.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters, device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(split)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = raw_model(x, y)
                losses[k] = loss
            mean = losses.mean()
            if ddp:
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            out[split] = mean.item()
        model.train()
        return out

    if master and args.wandb:
        import wandb
        wandb.init(project="gpt124m", config={**vars(args), **asdict(cfg)})

    x, y = get_batch("train")
    t0 = time.time()
    while iter_num < args.max_iters:
        lr = lr_at(iter_num)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if iter_num % args.eval_interval == 0 and iter_num > 0:
            losses = estimate_loss()
            if master:
                print(f"iter {iter_num}: train {losses['train']:.4f} val {losses['val']:.4f}", flush=True)
                if args.wandb:
                    wandb.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr})
                if losses["val"] < best_val:
                    best_val = losses["val"]
                    torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                                "iter_num": iter_num, "best_val": best_val, "config": asdict(cfg)}, ckpt_path)

        for micro in range(grad_accum):
            last = micro == grad_accum - 1
            ctx = model.no_sync() if (ddp and not last) else nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(x, y)
                    loss = loss / grad_accum
                x, y = get_batch("train")  # prefetch next micro batch while the GPU works
                loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        iter_num += 1
        if iter_num % 10 == 0 and master:
            dt = (time.time() - t0) / 10
            t0 = time.time()
            print(f"iter {iter_num} loss {loss.item() * grad_accum:.4f} (rank 0) norm {norm:.2f} "
                  f"{args.total_batch_tokens / dt / 1e3:.0f}k tok/s", flush=True)

    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
