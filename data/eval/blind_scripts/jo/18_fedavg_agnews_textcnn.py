"""FedAvg text classification on AG News with a TextCNN, Dirichlet label skew over clients.

Tokenisation + vocabulary + client partition take a few minutes on the 120k
articles, so the result is cached in --cache-dir and reused by later runs.

    torchrun --nproc_per_node=8 18_fedavg_agnews_textcnn.py --csv-dir /data/ag_news_csv --clients 500
"""
import argparse
import csv
import os
import re
import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

TOK = re.compile(r"\w+|[^\w\s]")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv-dir", default="/data/ag_news_csv")
    p.add_argument("--cache-dir", default="/scratch/cache/agnews")
    p.add_argument("--out", default="/scratch/exp/agnews_fedavg")
    p.add_argument("--clients", type=int, default=500)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--per-round", type=int, default=50)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--vocab-size", type=int, default=30000)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=21)
    return p.parse_args()


def read_csv(path):
    labels, texts = [], []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.reader(f):
            labels.append(int(row[0]) - 1)
            texts.append((row[1] + " " + row[2]).lower())
    return labels, texts


def encode(texts, vocab, max_len):
    out = torch.zeros(len(texts), max_len, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = [vocab.get(w, 1) for w in TOK.findall(t)][:max_len]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def dirichlet_split(labels, n_clients, alpha, seed):
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    parts = [[] for _ in range(n_clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.where(labels == c)[0])
        prop = rng.dirichlet(alpha * np.ones(n_clients))
        for k, ch in enumerate(np.split(idx, (np.cumsum(prop)[:-1] * len(idx)).astype(int))):
            parts[k].extend(ch.tolist())
    return [torch.tensor(p, dtype=torch.long) for p in parts]


def build_cache(args):
    y_tr, t_tr = read_csv(os.path.join(args.csv_dir, "train.csv"))
    y_te, t_te = read_csv(os.path.join(args.csv_dir, "test.csv"))
    counts = Counter(w for t in t_tr for w in TOK.findall(t))
    itos = ["<pad>", "<unk>"] + [w for w, _ in counts.most_common(args.vocab_size - 2)]
    vocab = {w: i for i, w in enumerate(itos)}
    return {
        "itos": itos,
        "x_train": encode(t_tr, vocab, args.max_len),
        "y_train": torch.tensor(y_tr),
        "x_test": encode(t_te, vocab, args.max_len),
        "y_test": torch.tensor(y_te),
        "parts": dirichlet_split(y_tr, args.clients, args.alpha, args.seed),
    }


class TextCNN(nn.Module):
    def __init__(self, vocab, dim=128, n_filters=128, widths=(3, 4, 5), n_classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(dim, n_filters, w) for w in widths)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(n_filters * len(widths), n_classes)

    def forward(self, x):
        e = self.emb(x).transpose(1, 2)
        h = torch.cat([F.relu(c(e)).amax(dim=2) for c in self.convs], dim=1)
        return self.fc(self.drop(h))


def local_train(model, x, y, epochs, bs, lr):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        perm = torch.randperm(len(y), device=y.device)
        for i in range(0, len(y), bs):
            b = perm[i:i + bs]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    os.makedirs(args.cache_dir, exist_ok=True)
    cache_file = os.path.join(
        args.cache_dir, f"agnews_v{args.vocab_size}_l{args.max_len}_c{args.clients}_a{args.alpha}_s{args.seed}.pt")
    if os.path.exists(cache_file):
        data = torch.load(cache_file)
    else:
        t0 = time.time()
        data = build_cache(args)
        torch.save(data, cache_file)
        print(f"[rank {rank}] built cache in {time.time() - t0:.0f}s -> {cache_file}", flush=True)

    x_train, y_train = data["x_train"].to(dev), data["y_train"].to(dev)
    x_test, y_test = data["x_test"][rank::world].to(dev), data["y_test"][rank::world].to(dev)
    parts = data["parts"]

    model = TextCNN(len(data["itos"])).to(dev)
    worker = TextCNN(len(data["itos"])).to(dev)
    for p in model.parameters():
        dist.broadcast(p.data, 0)

    best = 0.0
    for rnd in range(args.rounds):
        tic = time.time()
        chosen = np.random.default_rng(args.seed + 97 * rnd).choice(args.clients, args.per_round, replace=False)
        sums = [torch.zeros_like(p) for p in model.parameters()]
        n = torch.zeros(1, device=dev)
        for c in chosen[rank::world]:
            idx = parts[c].to(dev)
            if idx.numel() == 0:
                continue
            worker.load_state_dict(model.state_dict())
            local_train(worker, x_train[idx], y_train[idx], args.local_epochs, args.bs, args.lr)
            for s, p in zip(sums, worker.parameters()):
                s.add_(p.detach(), alpha=idx.numel())
            n += idx.numel()

        dist.all_reduce(n)
        for s in sums:
            dist.all_reduce(s)
        with torch.no_grad():
            for p, s in zip(model.parameters(), sums):
                p.copy_(s / n)

        if (rnd + 1) % 10 == 0:
            model.eval()
            with torch.no_grad():
                correct = sum((model(xb).argmax(1) == yb).sum() for xb, yb in
                              zip(x_test.split(2048), y_test.split(2048)))
            stat = torch.stack([correct.float(), torch.tensor(float(len(y_test)), device=dev)])
            dist.all_reduce(stat)
            acc = (stat[0] / stat[1]).item()
            if rank == 0:
                print(f"round {rnd + 1}: test acc {acc:.4f}  ({time.time() - tic:.1f}s)", flush=True)
                if acc > best:
                    best = acc
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.state_dict(), "itos": data["itos"], "round": rnd + 1},
                               os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
