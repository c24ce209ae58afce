"""Hand-written PBT for a small character-level transformer LM.

Each spawned process owns one GPU and one population member.  Every
``exploit_every`` steps the members publish (val_loss, step) to a leaderboard;
the worst members restart from a better member's checkpoint with perturbed
learning rate / dropout.

    python pbt_charlm.py --gpus 8 --text data/shakespeare.txt
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--text", default="data/shakespeare.txt")
    ap.add_argument("--out", default="runs/pbt_charlm")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--exploit-every", type=int, default=1000)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--truncate", type=float, default=0.25)
    ap.add_argument("--port", type=int, default=29511)
    return ap.parse_args()


class Block(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab, block, n_layer, d, n_head, dropout):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, block, d))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1))

    def set_dropout(self, p):
        for m in self.modules():
            if isinstance(m, nn.Dropout):
                m.p = p
            elif isinstance(m, nn.MultiheadAttention):
                m.dropout = p

    def forward(self, idx, targets=None):
        T_ = idx.size(1)
        x = self.drop(self.tok(idx) + self.pos[:, :T_])
        for blk in self.blocks:
            x = blk(x, self.mask[:T_, :T_])
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def load_corpus(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.int64)
    n = int(0.9 * len(data))
    return torch.from_numpy(data[:n]), torch.from_numpy(data[n:]), len(chars)


def get_batch(data, block, batch, device, gen=None):
    ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@torch.no_grad()
def estimate_val_loss(model, val, args, device, iters=50):
    model.eval()
    gen = torch.Generator().manual_seed(0)  # same val batches for every member
    losses = []
    for _ in range(iters):
        x, y = get_batch(val, args.block, args.batch, device, gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses.append(model(x, y).item())
    model.train()
    return float(np.mean(losses))


def leaderboard(val_loss, step, world_size):
    entry = torch.tensor([val_loss, float(step)])
    gathered = [torch.empty_like(entry) for _ in range(world_size)]
    dist.all_gather(gathered, entry)
    return [(r, g[0].item(), int(g[1].item())) for r, g in enumerate(gathered)]


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    rng = random.Random(1000 + rank)
    torch.manual_seed(rank)
    hp = {"lr": 10 ** rng.uniform(-4, -2.7), "dropout": rng.uniform(0.0, 0.3),
          "weight_decay": 10 ** rng.uniform(-3, -1)}

    train, val, vocab = load_corpus(args.text)
    model = CharLM(vocab, args.block, args.n_layer, args.n_embd, args.n_head,
                   hp["dropout"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=(0.9, 0.95),
                            weight_decay=hp["weight_decay"])
    ckpt_dir = os.path.join(args.out, "members")
    os.makedirs(ckpt_dir, exist_ok=True)

    t0 = time.time()
    for step in range(1, args.steps + 1):
        x, y = get_batch(train, args.block, args.batch, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        if step % args.exploit_every != 0:
            continue

        val_loss = estimate_val_loss(model, val, args, device)
        board = sorted(leaderboard(val_loss, step, world_size), key=lambda e: (e[1], e[0]))
        if rank == 0:
            print(f"step {step} ({time.time() - t0:.0f}s) " +
                  " ".join(f"m{r}:{l:.3f}" for r, l, _ in board), flush=True)
        if step == args.steps:
            break

        n_cut = max(1, int(math.floor(world_size * args.truncate)))
        top = [r for r, _, _ in board[:n_cut]]
        bottom = [r for r, _, _ in board[-n_cut:]]
        if rank in top:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hp": hp},
                       os.path.join(ckpt_dir, f"m{rank}.pt"))
        dist.barrier()
        if rank in bottom:
            donor = rng.choice(top)
            state = torch.load(os.path.join(ckpt_dir, f"m{donor}.pt"), map_location=device)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            hp = dict(state["hp"])
            hp["lr"] *= rng.choice([0.8, 1.25])
            hp["dropout"] = min(0.5, max(0.0, hp["dropout"] + rng.uniform(-0.05, 0.05)))
            for g in opt.param_groups:
                g["lr"] = hp["lr"]
            model.set_dropout(hp["dropout"])
        dist.barrier()

    if rank == board[0][0]:
        torch.save({"model": model.state_dict(), "hp": hp, "val_loss": board[0][1]},
                   os.path.join(args.out, "best.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
