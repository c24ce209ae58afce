#!/usr/bin/env python3
"""
BiLSTM sentiment classifier on Yelp polarity (the fast.ai csv version),
spread over the three boxes in the flat with mp.spawn, no torchrun.

    box 0: 192.168.1.70  RTX 3060 12GB   (master)
    box 1: 192.168.1.71  GTX 1660 Super
    box 2: 192.168.1.72  RTX 2060

on each box (same --nnodes, its own --node-rank):
    python yelp_lstm.py --nnodes 3 --node-rank 0 --master 192.168.1.70
    python yelp_lstm.py --nnodes 3 --node-rank 1 --master 192.168.1.70
    python yelp_lstm.py --nnodes 3 --node-rank 2 --master 192.168.1.70

The vocabulary is rebuilt on every process from the same csv; ties in the
counts are broken by the token itself, so all processes get the same ids.
"""
import argparse
import csv
import os
import re
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

TOKEN_RE = re.compile(r"[a-z0-9']+|[!?.,]")
PAD, UNK = 0, 1


def tokenize(text):
    return TOKEN_RE.findall(text.lower().replace("\\n", " "))


def read_csv(path, limit=None):
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for i, (label, text) in enumerate(csv.reader(f)):
            if limit is not None and i >= limit:
                break
            rows.append((int(label) - 1, tokenize(text)))
    return rows


def build_vocab(rows, max_size, min_freq=3):
    counts = Counter(tok for _, toks in rows for tok in toks)
    items = sorted((kv for kv in counts.items() if kv[1] >= min_freq), key=lambda kv: (-kv[1], kv[0]))
    itos = ["<pad>", "<unk>"] + [tok for tok, _ in items[: max_size - 2]]
    return {tok: i for i, tok in enumerate(itos)}


class ReviewDataset(Dataset):
    def __init__(self, rows, vocab, max_len):
        self.data = [(torch.tensor([vocab.get(t, UNK) for t in toks[:max_len]] or [UNK]), y)
                     for y, toks in rows]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def collate(batch):
    seqs, labels = zip(*batch)
    lengths = torch.tensor([len(s) for s in seqs])
    return pad_sequence(seqs, batch_first=True, padding_value=PAD), lengths, torch.tensor(labels)


class BiLSTM(nn.Module):
    def __init__(self, vocab_size, emb=200, hidden=256, layers=2, dropout=0.3):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb, padding_idx=PAD)
        self.lstm = nn.LSTM(emb, hidden, num_layers=layers, bidirectional=True,
                            batch_first=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(hidden * 2, 2)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.emb(x), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        feat = torch.cat([h[-2], h[-1]], dim=1)
        return self.fc(self.drop(feat))


def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, lengths, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            stats[0] += (model(x, lengths).argmax(1) == y).sum()
            stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def worker(local_rank, args, gpus_per_node):
    rank = args.node_rank * gpus_per_node + local_rank
    world_size = args.nnodes * gpus_per_node
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{args.master}:{args.port}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", local_rank)

    train_rows = read_csv(os.path.join(args.data, "train.csv"), args.max_train)
    test_rows = read_csv(os.path.join(args.data, "test.csv"))
    vocab = build_vocab(train_rows, args.vocab_size)
    train_ds = ReviewDataset(train_rows, vocab, args.max_len)
    test_ds = ReviewDataset(test_rows, vocab, args.max_len)
    del train_rows, test_rows

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    # strided shard of the test set, no padding, so every review is counted exactly once
    test_part = Subset(test_ds, range(rank, len(test_ds), world_size))
    test_dl = DataLoader(test_part, batch_size=256, collate_fn=collate, num_workers=2)

    model = BiLSTM(len(vocab)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    crit = nn.CrossEntropyLoss()
    if rank == 0:
        print(f"world {world_size}, vocab {len(vocab)}, {len(train_ds)} train reviews", flush=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, lengths, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(x, lengths), y)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            loss_sum += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(loss_sum)
        acc = evaluate(model.module, test_dl, device)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"test acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.state_dict(), "vocab": vocab, "epoch": epoch}, args.ckpt)
        dist.barrier()

    if rank == 0:
        # export for the little inference server: plain nn.Module keys
        ckpt = torch.load(args.ckpt, map_location="cpu")
        state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in ckpt["model"].items()}
        export = BiLSTM(len(vocab))
        export.load_state_dict(state)
        torch.save({"model": export.state_dict(), "vocab": vocab}, args.ckpt.replace(".pt", "_export.pt"))
        print("exported", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.expanduser("~/data/yelp_review_polarity_csv"))
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--max-train", type=int, default=200_000)
    ap.add_argument("--vocab-size", type=int, default=50_000)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--ckpt", default="yelp_bilstm.pt")
    args = ap.parse_args()

    gpus_per_node = torch.cuda.device_count()
    mp.spawn(worker, args=(args, gpus_per_node), nprocs=gpus_per_node, join=True)


if __name__ == "__main__":
    main()
