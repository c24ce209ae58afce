"""FedProx next-character prediction on Shakespeare with a 2-layer LSTM.

The corpus (tiny-shakespeare) is cut into fixed-length sequences which are
distributed over the clients with Dirichlet(alpha) *quantity* skew, so clients
hold very different amounts of text. One client per rank.

    torchrun --nproc_per_node=8 20_fedprox_shakespeare_lstm.py --text data/tinyshakespeare.txt
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="data/tinyshakespeare.txt")
    ap.add_argument("--save", default="ckpt/fedprox_shakespeare.pt")
    ap.add_argument("--seq_len", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--local_epochs", type=int, default=1)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.8)
    ap.add_argument("--mu", type=float, default=0.001)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--log_interval", type=int, default=20)
    ap.add_argument("--seed", type=int, default=2)
    return ap.parse_args()


class CharSeqs(Dataset):
    def __init__(self, ids, starts, seq_len):
        self.ids, self.starts, self.seq_len = ids, starts, seq_len

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        chunk = self.ids[s:s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class CharLSTM(nn.Module):
    def __init__(self, vocab, emb=8, hidden=256, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=layers, batch_first=True)
        self.proj = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.lstm(self.embed(x))
        return self.proj(out)


def quantity_skew(n_items, n_clients, alpha, rng, min_items=8):
    while True:
        share = rng.dirichlet(np.full(n_clients, alpha))
        counts = np.floor(share * n_items).astype(int)
        if counts.min() >= min_items:
            break
    order = rng.permutation(n_items)
    bounds = np.cumsum(counts)[:-1]
    return np.split(order[:counts.sum()], bounds)


def local_round(model, loader, args, device, rank, rnd):
    anchor = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    model.train()
    total, n_tok = 0.0, 0
    for _ in range(args.local_epochs):
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            prox = sum(torch.sum((p - a) ** 2) for p, a in zip(model.parameters(), anchor))
            opt.zero_grad(set_to_none=True)
            (nll + 0.5 * args.mu * prox).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            total += nll.item() * y.numel()
            n_tok += y.numel()

            if step % args.log_interval == 0:
                running = torch.tensor([nll.item()], device=device)
                dist.all_reduce(running)
                if rank == 0:
                    print(f"  round {rnd} step {step}: mean client loss "
                          f"{running.item() / dist.get_world_size():.3f}", flush=True)
    return total, n_tok


@torch.no_grad()
def fedavg_(model, weight):
    for p in model.parameters():
        p.mul_(weight)
        dist.all_reduce(p)


@torch.no_grad()
def eval_ppl(model, loader, device):
    model.eval()
    s = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        s[0] += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        s[1] += y.numel()
    dist.all_reduce(s)
    return math.exp((s[0] / s[1]).item())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)

    n_val = len(ids) // 10
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    starts = np.arange(0, len(train_ids) - args.seq_len - 1, args.seq_len)
    rng = np.random.default_rng(args.seed)
    client_starts = quantity_skew(len(starts), world, args.alpha, rng)
    mine = starts[client_starts[rank]]
    n_local = len(mine)

    train_loader = DataLoader(CharSeqs(train_ids, mine, args.seq_len), batch_size=args.batch_size,
                              shuffle=True, drop_last=False)
    val_starts = np.arange(0, len(val_ids) - args.seq_len - 1, args.seq_len)[rank::world]
    val_loader = DataLoader(CharSeqs(val_ids, val_starts, args.seq_len), batch_size=128)

    model = CharLSTM(len(chars)).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

    n_sum = torch.tensor([float(n_local)], device=device)
    dist.all_reduce(n_sum)
    weight = n_local / n_sum.item()
    if rank == 0:
        print(f"vocab {len(chars)}, {int(n_sum.item())} training sequences over {world} clients")
    print(f"[client {rank}] {n_local} sequences", flush=True)

    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        tot, ntok = local_round(model, train_loader, args, device, rank, rnd)
        fedavg_(model, weight)
        tr = torch.tensor([tot, float(ntok)], dtype=torch.float64, device=device)
        dist.all_reduce(tr)
        val_ppl = eval_ppl(model, val_loader, device)
        if rank == 0:
            print(f"round {rnd:3d} | train ppl {math.exp((tr[0] / tr[1]).item()):.2f} | "
                  f"val ppl {val_ppl:.2f} | {time.time() - t0:.1f}s", flush=True)
            os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
            torch.save({"round": rnd, "model": model.state_dict(), "vocab": chars}, args.save)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
