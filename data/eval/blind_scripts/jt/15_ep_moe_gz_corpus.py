"""
Expert-parallel MoE LM, streaming pre-tokenized documents from jsonl.gz shards.

Each shard line is {"ids": [...]}; documents are packed into seq_len+1 windows on the fly.
Shards are split across ranks (and then across DataLoader workers), one pass per epoch.

    torchrun --nproc_per_node=8 15_ep_moe_gz_corpus.py --train_glob "/data/tok/train-*.jsonl.gz" \
        --val_bin /data/tok/val.bin --epochs 3
"""
import argparse
import glob
import gzip
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler


class PackedJsonlStream(IterableDataset):
    def __init__(self, files, seq_len, eos_id):
        self.files, self.seq_len, self.eos_id = files, seq_len, eos_id

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        buf = []
        for path in files:
            with gzip.open(path, "rt") as f:
                for line in f:
                    buf.extend(json.loads(line)["ids"])
                    buf.append(self.eos_id)
                    while len(buf) >= self.seq_len + 1:
                        w = torch.tensor(buf[:self.seq_len + 1], dtype=torch.long)
                        buf = buf[self.seq_len + 1:]
                        yield w[:-1], w[1:]


class ValBin(Dataset):
    def __init__(self, path, seq_len):
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        m = np.memmap(self.path, dtype=np.uint16, mode="r")
        w = torch.from_numpy(m[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, g):
        return AllToAll.apply(g)


class ExpertParallelFFN(nn.Module):
    def __init__(self, d, n_experts, k, cap_factor):
        super().__init__()
        self.ep = dist.get_world_size()
        self.n_experts, self.k, self.cap_factor = n_experts, k, cap_factor
        self.n_local = n_experts // self.ep
        self.wg = nn.Linear(d, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(self.n_local, d, 4 * d) * 0.02)
        self.w_out = nn.Parameter(torch.randn(self.n_local, 4 * d, d) * 0.02 / math.sqrt(2))
        self.balance = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        n = x.size(0)
        probs = self.wg(x).float().softmax(-1)
        g, e = probs.topk(self.k, -1)
        g = g / g.sum(-1, keepdim=True)
        self.balance = self.n_experts * (F.one_hot(e, self.n_experts).float().mean((0, 1)) * probs.mean(0)).sum()
        cap = math.ceil(self.cap_factor * n * self.k / self.n_experts)
        e1, g1 = e.t().reshape(-1), g.t().reshape(-1)
        t1 = torch.arange(n, device=x.device).repeat(self.k)
        oh = F.one_hot(e1, self.n_experts)
        pos = (oh.cumsum(0) * oh).sum(-1) - 1
        keep = pos < cap
        slot, tok = e1[keep] * cap + pos[keep], t1[keep]
        send = x.new_zeros(self.n_experts * cap, D)
        send[slot] = x[tok]
        h = AllToAll.apply(send).view(self.ep, self.n_local, cap, D).transpose(0, 1).reshape(self.n_local, -1, D)
        h = torch.bmm(F.gelu(torch.bmm(h, self.w_in.to(h.dtype))), self.w_out.to(h.dtype))
        h = h.view(self.n_local, self.ep, cap, D).transpose(0, 1).reshape(-1, D)
        h = AllToAll.apply(h)
        y = torch.zeros(n, D, device=x.device, dtype=h.dtype)
        y.index_add_(0, tok, h[slot] * g1[keep, None].to(h.dtype))
        return y.to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, d, heads, moe, a):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn_in = nn.Linear(d, 3 * d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ffn = (ExpertParallelFFN(d, a.experts, a.top_k, a.capacity_factor) if moe else
                    nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.attn_in(self.ln1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.attn_out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.ffn(self.ln2(x))


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.d)
        self.pos = nn.Embedding(a.seq_len, a.d)
        self.blocks = nn.ModuleList(Block(a.d, a.heads, i % 2 == 1, a) for i in range(a.layers))
        self.ln = nn.LayerNorm(a.d)
        self.head = nn.Linear(a.d, a.vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x)).float()
        bal = torch.stack([b.ffn.balance for b in self.blocks if isinstance(b.ffn, ExpertParallelFFN)]).mean()
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten()), bal


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_glob", required=True)
    ap.add_argument("--val_bin", required=True)
    ap.add_argument("--out", default="ckpt/ep_stream")
    ap.add_argument("--eos_id", type=int, default=50256)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--capacity_factor", type=float, default=1.25)
    ap.add_argument("--balance_coef", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--eval_every", type=int, default=1000)
    a = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    torch.manual_seed(7 + rank)
    model = Model(a).to(dev)
    expert_p = [p for n, p in model.named_parameters() if n.endswith(("w_in", "w_out"))]
    dense_p = [p for n, p in model.named_parameters() if not n.endswith(("w_in", "w_out"))]
    for p in dense_p:
        dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    files = sorted(glob.glob(a.train_glob))
    my_files = files[rank::world]
    train_dl = DataLoader(PackedJsonlStream(my_files, a.seq_len, a.eos_id), batch_size=a.batch,
                          num_workers=4, pin_memory=True)
    val_ds = ValBin(a.val_bin, a.seq_len)
    val_dl = DataLoader(val_ds, batch_size=a.batch, num_workers=2,
                        sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"{len(files)} shards, ~{len(my_files)} per rank, {a.experts // world} experts per rank")

    def sync_grads():
        grads = [p.grad for p in dense_p]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world
        for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(s)
        for p in expert_p:
            p.grad /= world

    @torch.no_grad()
    def evaluate(max_batches=100):
        model.eval()
        acc = torch.zeros(2, device=dev)
        for i, (x, y) in enumerate(val_dl):
            if i == max_batches:
                break
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = model(x.to(dev), y.to(dev))
            acc += torch.stack([loss, torch.ones_like(loss)])
        dist.all_reduce(acc)
        model.train()
        return (acc[0] / acc[1]).item()

    step, t0 = 0, time.time()
    for epoch in range(a.epochs):
        for x, y in train_dl:
            lr = a.lr * min(1.0, (step + 1) / 2000)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, bal = model(x, y)
            (loss + a.balance_coef * bal).backward()
            sync_grads()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                s = torch.stack([loss.detach(), bal.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {s[0]:.4f} balance {s[1]:.4f} "
                          f"{(time.time() - t0) / 50:.3f}s/step", flush=True)
                t0 = time.time()
            if step % a.eval_every == 0:
                vl = evaluate()
                sd = model.state_dict()
                if rank == 0:
                    print(f"step {step} val {vl:.4f}", flush=True)
                    torch.save({k: v for k, v in sd.items() if not k.endswith(("w_in", "w_out"))},
                               os.path.join(a.out, "dense.pt"))
                torch.save({k: v for k, v in sd.items() if k.endswith(("w_in", "w_out"))},
                           os.path.join(a.out, f"experts_r{rank}.pt"))
        if rank == 0:
            print(f"finished epoch {epoch} at step {step}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
