"""
Single-node MoE LM pretraining launched with torch.multiprocessing.spawn (no torchrun needed).

    python 18_spawn_moe_pretrain.py --data data/wikitext103_tok --gpus 4
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Chunks(Dataset):
    def __init__(self, path, seq):
        self.path, self.seq = path, seq
        self.n = (os.path.getsize(path) // 2 - 1) // seq
        self.mm = None  # opened lazily so the dataset pickles cheaply into workers

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        c = torch.from_numpy(self.mm[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return c[:-1], c[1:]


class Top2MoE(nn.Module):
    def __init__(self, d, n_exp, cf):
        super().__init__()
        self.n_exp, self.cf = n_exp, cf
        self.gate = nn.Linear(d, n_exp, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n_exp))
        self.aux = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        probs = self.gate(x).float().softmax(-1)
        w, idx = probs.topk(2, -1)
        w = w / w.sum(-1, keepdim=True)
        self.aux = self.n_exp * (F.one_hot(idx, self.n_exp).float().mean((0, 1)) * probs.mean(0)).sum()
        cap = math.ceil(self.cf * 2 * x.size(0) / self.n_exp)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                # keep the idle expert in the graph with a zero contribution, so DDP sees
                # a gradient for every parameter in every step
                y = y + sum(p.sum() for p in expert.parameters()) * 0.0
                continue
            tok, slot = tok[:cap], slot[:cap]
            y = y.index_add(0, tok, (expert(x[tok]) * w[tok, slot, None]).to(y.dtype))
        return y.view(B, T, D)


class Block(nn.Module):
    def __init__(self, d, nh, n_exp, cf):
        super().__init__()
        self.nh = nh
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.moe = Top2MoE(d, n_exp, cf)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.nh, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.d)
        self.pos = nn.Embedding(a.seq, a.d)
        self.blocks = nn.ModuleList(Block(a.d, a.heads, a.experts, a.cf) for _ in range(a.layers))
        self.ln = nn.LayerNorm(a.d)
        self.out = nn.Linear(a.d, a.vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.out(self.ln(x)).float()
        aux = torch.stack([b.moe.aux for b in self.blocks]).mean()
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten()), aux


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train = Chunks(os.path.join(args.data, "train.bin"), args.seq)
    valid = Chunks(os.path.join(args.data, "valid.bin"), args.seq)
    ts = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    vs = DistributedSampler(valid, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    tl = DataLoader(train, args.bs, sampler=ts, num_workers=3, pin_memory=True, drop_last=True)
    vl = DataLoader(valid, args.bs, sampler=vs, num_workers=2, pin_memory=True)

    model = MoELM(args).to(device)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.load_state_dict(ck["model"])
        start_epoch = ck["epoch"] + 1
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    if args.resume:
        opt.load_state_dict(ck["opt"])
    total_steps = args.epochs * len(tl)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - args.warmup) / (total_steps - args.warmup)))

    step = start_epoch * len(tl)
    for epoch in range(start_epoch, args.epochs):
        ts.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        run = torch.zeros(3, device=device)
        for x, y in tl:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ce, aux = ddp(x, y)
            opt.zero_grad(set_to_none=True)
            (ce + args.aux_coef * aux).backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            step += 1
            run += torch.stack([ce.detach(), aux.detach(), torch.ones((), device=device)])
            if step % 100 == 0:
                dist.all_reduce(run)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total_steps} ce {run[0] / run[2]:.4f} "
                          f"aux {run[1] / run[2]:.4f} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                run.zero_()
                t0 = time.time()

        ddp.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in vl:
                ce, _ = ddp(x.to(device), y.to(device))
                acc += torch.stack([ce.float() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            vloss = (acc[0] / acc[1]).item()
            print(f"epoch {epoch} valid loss {vloss:.4f} ppl {math.exp(vloss):.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="checkpoints/spawn_moe")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", default="29512")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--cf", type=float, default=1.25)
    ap.add_argument("--aux_coef", type=float, default=0.01)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
