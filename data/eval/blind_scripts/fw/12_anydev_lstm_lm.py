#!/usr/bin/env python
"""Word-level LSTM language model (PTB / WikiText-103 style), data parallel.

Written to run unchanged on whatever the cluster partition has: AMD or NVIDIA
GPUs, Intel XPUs, Ascend NPUs, or plain Xeon nodes.

    # cpu partition, 2 nodes x 4 processes
    srun -p cpu -N2 --ntasks-per-node=1 -c 64 torchrun --nnodes=2 --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 --rdzv_id=$SLURM_JOB_ID \
        12_anydev_lstm_lm.py --data /shared/corpora/wikitext-103 --save /shared/runs/lstm_lm.pt
"""
import argparse
import math
import os
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--emsize", type=int, default=400)
    p.add_argument("--nhid", type=int, default=1150)
    p.add_argument("--nlayers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--bptt", type=int, default=70)
    p.add_argument("--batch_size", type=int, default=40, help="streams per process")
    p.add_argument("--lr", type=float, default=1e-3, help="lr for 40 streams; scaled by sqrt(world)")
    p.add_argument("--clip", type=float, default=0.25)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--min_freq", type=int, default=3)
    p.add_argument("--seed", type=int, default=1111)
    return p.parse_args()


def pick_device(local_rank):
    if torch.cuda.is_available():  # CUDA and ROCm builds
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.set_device(local_rank)
        return torch.device("xpu", local_rank)
    try:
        import torch_npu  # noqa: F401
        if torch.npu.is_available():
            torch.npu.set_device(local_rank)
            return torch.device("npu", local_rank)
    except ImportError:
        pass
    torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    return torch.device("cpu")


class Corpus:
    """Vocabulary built deterministically from the training file (same on every rank)."""

    def __init__(self, root, min_freq):
        counts = Counter()
        with open(os.path.join(root, "train.txt"), encoding="utf8") as f:
            for line in f:
                counts.update(line.split() + ["<eos>"])
        words = sorted(w for w, c in counts.items() if c >= min_freq)
        self.itos = ["<unk>"] + [w for w in words if w != "<unk>"]
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.train = self.tokenize(os.path.join(root, "train.txt"))
        self.valid = self.tokenize(os.path.join(root, "valid.txt"))

    def tokenize(self, path):
        unk = self.stoi["<unk>"]
        ids = []
        with open(path, encoding="utf8") as f:
            for line in f:
                ids.extend(self.stoi.get(w, unk) for w in line.split() + ["<eos>"])
        return torch.tensor(ids, dtype=torch.long)


def shard_stream(data, rank, world, bsz):
    """Give each rank a contiguous, equally long slice, then fold it into bsz streams."""
    per_rank = data.size(0) // world
    part = data[rank * per_rank:(rank + 1) * per_rank]
    nbatch = part.size(0) // bsz
    return part[: nbatch * bsz].view(bsz, -1).t().contiguous()  # [T, bsz]


class LSTMLM(nn.Module):
    def __init__(self, ntoken, emsize, nhid, nlayers, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, emsize)
        self.rnn = nn.LSTM(emsize, nhid, nlayers, dropout=dropout)
        self.proj = nn.Linear(nhid, emsize)
        self.decoder = nn.Linear(emsize, ntoken)
        self.decoder.weight = self.encoder.weight  # weight tying

    def forward(self, x, hidden=None):
        out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(self.proj(out))), hidden


def detach(h):
    return tuple(t.detach() for t in h)


def run_epoch(model, stream, bptt, device, optimizer=None, clip=0.0):
    training = optimizer is not None
    model.train(training)
    crit = nn.CrossEntropyLoss(reduction="sum")
    hidden, total, ntok = None, 0.0, 0
    with torch.set_grad_enabled(training):
        for i in range(0, stream.size(0) - 1, bptt):
            seq = min(bptt, stream.size(0) - 1 - i)
            x = stream[i:i + seq].to(device)
            y = stream[i + 1:i + 1 + seq].to(device)
            out, hidden = model(x, hidden)
            hidden = detach(hidden)
            loss = crit(out.view(-1, out.size(-1)), y.reshape(-1))
            if training:
                optimizer.zero_grad(set_to_none=True)
                (loss / y.numel()).backward()
                nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
            total += loss.item()
            ntok += y.numel()
    return total, ntok


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    t0 = time.time()
    corpus = Corpus(args.data, args.min_freq)
    train = shard_stream(corpus.train, rank, world, args.batch_size)
    valid = shard_stream(corpus.valid, rank, world, 10)
    if rank == 0:
        print(f"device={device} world={world} vocab={len(corpus.itos)} "
              f"train_tokens/rank={train.numel()} ({time.time() - t0:.0f}s)", flush=True)

    model = LSTMLM(len(corpus.itos), args.emsize, args.nhid, args.nlayers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type != "cpu" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * math.sqrt(world * args.batch_size / 40),
                                 weight_decay=1.2e-6)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    best_ppl = math.inf
    for epoch in range(1, args.epochs + 1):
        ep_t = time.time()
        tr_loss, tr_tok = run_epoch(model, train, args.bptt, device, optimizer, args.clip)
        va_loss, va_tok = run_epoch(model.module, valid, args.bptt, device)
        stats = torch.tensor([tr_loss, tr_tok, va_loss, va_tok], dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        train_ppl = math.exp(stats[0].item() / stats[1].item())
        val_ppl = math.exp(stats[2].item() / stats[3].item())
        scheduler.step()
        if rank == 0:
            print(f"| epoch {epoch:2d} | {time.time() - ep_t:6.0f}s | train ppl {train_ppl:8.2f} "
                  f"| valid ppl {val_ppl:8.2f}", flush=True)
            if val_ppl < best_ppl:
                best_ppl = val_ppl
                torch.save({"model": model.module.state_dict(), "itos": corpus.itos, "args": vars(args)},
                           args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
