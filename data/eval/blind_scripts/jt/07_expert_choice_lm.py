"""Expert-choice routing MoE LM (each expert picks its top-C tokens), DDP.

Raw jsonl text is tokenized once and cached as a flat uint16 array next to the data.

torchrun --nproc_per_node=8 07_expert_choice_lm.py \
    --train_jsonl /data/slimpajama_sample/train.jsonl --val_jsonl /data/slimpajama_sample/val.jsonl
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer


def tokenize_to_cache(jsonl_path, tokenizer_name, cache_path):
    if os.path.exists(cache_path):
        return cache_path
    tok = AutoTokenizer.from_pretrained(tokenizer_name)
    eos = tok.eos_token_id
    ids = []
    with open(jsonl_path) as f:
        for line in f:
            text = json.loads(line)["text"]
            ids.extend(tok(text, add_special_tokens=False)["input_ids"])
            ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    np.save(cache_path, arr)
    return cache_path


class CachedTokens(Dataset):
    def __init__(self, npy_path, seq_len):
        self.npy_path, self.seq_len = npy_path, seq_len
        self.num = (np.load(npy_path, mmap_mode="r").shape[0] - 1) // seq_len
        self.arr = None

    def __len__(self):
        return self.num

    def __getitem__(self, i):
        if self.arr is None:
            self.arr = np.load(self.npy_path, mmap_mode="r")
        s = i * self.seq_len
        chunk = torch.from_numpy(self.arr[s:s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class ExpertChoiceMoE(nn.Module):
    def __init__(self, dim, n_experts, capacity_factor):
        super().__init__()
        self.n_experts = n_experts
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w_up = nn.Parameter(torch.empty(n_experts, dim, 4 * dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, 4 * dim, dim))
        nn.init.normal_(self.w_up, std=0.02)
        nn.init.normal_(self.w_down, std=0.02 / math.sqrt(2))
        self.coverage = None

    def forward(self, x):
        B, T, D = x.shape
        tokens = x.reshape(-1, D)
        n = tokens.size(0)
        cap = max(1, int(self.capacity_factor * n / self.n_experts))
        probs = self.router(tokens).float().softmax(dim=-1)       # [n, E]
        gate, idx = probs.t().topk(cap, dim=-1)                   # [E, cap]
        picked = tokens[idx]                                      # [E, cap, D]
        h = F.gelu(torch.bmm(picked, self.w_up.to(picked.dtype)))
        out = torch.bmm(h, self.w_down.to(h.dtype)) * gate.unsqueeze(-1).to(h.dtype)
        y = torch.zeros(n, D, device=x.device, dtype=out.dtype)
        y.index_add_(0, idx.reshape(-1), out.reshape(-1, D))
        seen = torch.zeros(n, device=x.device)
        seen[idx.reshape(-1)] = 1.0
        self.coverage = seen.mean()        # share of tokens that reached at least one expert
        return y.to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, dim, heads, n_experts, capacity_factor):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.moe = ExpertChoiceMoE(dim, n_experts, capacity_factor)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.moe(self.ln2(x))


class ECLM(nn.Module):
    def __init__(self, vocab, seq_len, dim, heads, layers, n_experts, capacity_factor):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, n_experts, capacity_factor) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_jsonl", required=True)
    ap.add_argument("--val_jsonl", required=True)
    ap.add_argument("--tokenizer", default="EleutherAI/gpt-neox-20b")
    ap.add_argument("--cache_dir", default="/data/slimpajama_sample/cache")
    ap.add_argument("--out", default="runs/expert_choice")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--capacity_factor", type=float, default=2.0)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--max_steps", type=int, default=30000)
    ap.add_argument("--eval_every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_npy = tokenize_to_cache(args.train_jsonl, args.tokenizer, os.path.join(args.cache_dir, "train_tokens.npy"))
    val_npy = tokenize_to_cache(args.val_jsonl, args.tokenizer, os.path.join(args.cache_dir, "val_tokens.npy"))
    train_ds = CachedTokens(train_npy, args.seq_len)
    val_ds = CachedTokens(val_npy, args.seq_len)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)

    vocab = 50304  # gpt-neox tokenizer (50277) padded to a multiple of 64
    model = ECLM(vocab, args.seq_len, args.dim, args.heads, args.layers, args.experts, args.capacity_factor)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.max_steps) / args.max_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    def coverage():
        m = model.module
        return torch.stack([b.moe.coverage for b in m.blocks]).mean()

    @torch.no_grad()
    def evaluate():
        model.eval()
        acc = torch.zeros(3, device=device)
        for x, y in val_loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            acc[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            acc[1] += y.numel()
            acc[2] += coverage() * y.numel()
        dist.all_reduce(acc)
        model.train()
        return (acc[0] / acc[1]).item(), (acc[2] / acc[1]).item()

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                s = torch.stack([loss.detach(), coverage().detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {s[0]:.4f} coverage {s[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 50:.3f}s/step", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl, vc = evaluate()
                if rank == 0:
                    print(f"== step {step} val loss {vl:.4f} ppl {math.exp(vl):.2f} coverage {vc:.3f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "step": step, "args": vars(args)},
                               os.path.join(args.out, f"ckpt_{step}.pt"))
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
