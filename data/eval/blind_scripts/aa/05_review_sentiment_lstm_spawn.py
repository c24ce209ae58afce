"""Product-review sentiment (1-5 stars) with a BiLSTM, single node, mp.spawn.

    python 05_review_sentiment_lstm_spawn.py --train data/reviews_train.jsonl \
        --test data/reviews_test.jsonl --gpus 4
"""
import argparse
import collections
import json
import os
import re

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler

SPECIALS = ["<pad>", "<unk>"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", default="29533")
    p.add_argument("--vocab-size", type=int, default=50000)
    p.add_argument("--emb", type=int, default=300)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out", default="checkpoints/sentiment_lstm")
    return p.parse_args()


def tokenize(s):
    return re.findall(r"\w+|[!?.,]", s.lower())


def read_jsonl(path):
    texts, stars = [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if not r.get("text") or r.get("stars") not in (1, 2, 3, 4, 5):
                continue
            texts.append(r["text"])
            stars.append(int(r["stars"]) - 1)
    return texts, stars


def build_vocab(texts, size):
    c = collections.Counter(tok for t in texts for tok in tokenize(t))
    itos = SPECIALS + [w for w, _ in c.most_common(size - len(SPECIALS))]
    return {w: i for i, w in enumerate(itos)}


class ReviewDataset(Dataset):
    def __init__(self, texts, labels, vocab, max_len):
        unk = vocab["<unk>"]
        self.ids = [[vocab.get(t, unk) for t in tokenize(x)][:max_len] or [unk] for x in texts]
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.tensor(self.ids[i], dtype=torch.long), self.labels[i]


def collate(batch):
    seqs, ys = zip(*batch)
    lengths = torch.tensor([len(s) for s in seqs])
    return pad_sequence(seqs, batch_first=True), lengths, torch.tensor(ys)


class BiLSTMClassifier(nn.Module):
    def __init__(self, vocab_size, emb, hidden, layers, n_classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb, padding_idx=0)
        self.lstm = nn.LSTM(emb, hidden, num_layers=layers, batch_first=True, bidirectional=True, dropout=0.3)
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(2 * hidden + emb, n_classes))

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.emb(x), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        h = torch.cat([h[-2], h[-1]], dim=1)  # last layer, both directions
        mean = self.emb(x).sum(1) / lengths.unsqueeze(1).to(x.device)
        return self.head(torch.cat([h, mean], dim=1))


def run_eval(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, lengths, y in loader:
            x, y = x.to(device), y.to(device)
            stats[0] += (model(x, lengths).argmax(1) == y).sum()
            stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def train_worker(rank, world_size, args, vocab):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    texts, stars = read_jsonl(args.train)
    full = ReviewDataset(texts, stars, vocab, args.max_len)
    n_val = len(full) // 20
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val], generator=torch.Generator().manual_seed(0))
    test_ds = ReviewDataset(*read_jsonl(args.test), vocab, args.max_len)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank)
    train_dl = DataLoader(train_ds, args.bs, sampler=train_sampler, collate_fn=collate, num_workers=2, drop_last=True)
    val_dl = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, world_size, rank, shuffle=False),
                        collate_fn=collate)
    test_dl = DataLoader(test_ds, 256, sampler=DistributedSampler(test_ds, world_size, rank, shuffle=False),
                         collate_fn=collate)

    model = BiLSTMClassifier(len(vocab), args.emb, args.hidden, args.layers).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * (world_size ** 0.5))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loss_fn = nn.CrossEntropyLoss()

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (x, lengths, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = loss_fn(model(x, lengths), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and step % 200 == 0:
                print(f"[epoch {epoch}] step {step} loss {loss.item():.4f}", flush=True)
        sched.step()
        val_acc = run_eval(model, val_dl, device)
        if rank == 0:
            print(f"[epoch {epoch}] val_acc {val_acc:.4f}", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save({"model": model.module.state_dict(), "vocab": vocab, "args": vars(args)},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    state = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(state["model"])
    test_acc = run_eval(model, test_dl, device)
    if rank == 0:
        print(f"test_acc {test_acc:.4f}", flush=True)
    dist.destroy_process_group()


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    # build the vocabulary once in the parent so every worker gets the same one
    texts, _ = read_jsonl(args.train)
    vocab = build_vocab(texts, args.vocab_size)
    print(f"vocab size {len(vocab)}; spawning {args.gpus} workers")
    mp.spawn(train_worker, args=(args, args.gpus, vocab), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
