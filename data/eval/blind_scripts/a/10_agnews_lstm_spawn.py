"""AG News topic classification with a BiLSTM, multi-GPU via torch.multiprocessing.spawn.

Data: the AG News csv files (class index, title, description), no header.

    python train_agnews.py --train data/ag_news/train.csv --test data/ag_news/test.csv --gpus 4
"""
import argparse
import csv
import re
import socket
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

TOKEN_RE = re.compile(r"[a-z0-9']+")
PAD, UNK = 0, 1


def tokenize(text):
    return TOKEN_RE.findall(text.lower())


def read_csv(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for label, title, desc in csv.reader(f):
            rows.append((int(label) - 1, title + " " + desc))
    return rows


def build_vocab(rows, max_size=50000, min_freq=2):
    counter = Counter(tok for _, text in rows for tok in tokenize(text))
    # sort by (-count, token) so the vocabulary is the same in every run and every process
    words = [w for w, c in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_freq]
    itos = ["<pad>", "<unk>"] + words[: max_size - 2]
    return {w: i for i, w in enumerate(itos)}


class NewsDataset(Dataset):
    def __init__(self, rows, vocab, max_len=128):
        self.rows, self.vocab, self.max_len = rows, vocab, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        label, text = self.rows[i]
        ids = [self.vocab.get(t, UNK) for t in tokenize(text)][: self.max_len] or [UNK]
        return torch.tensor(ids, dtype=torch.long), label


def collate(batch):
    seqs, labels = zip(*batch)
    lengths = torch.tensor([len(s) for s in seqs])
    padded = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    return padded, lengths, torch.tensor(labels)


class BiLSTMClassifier(nn.Module):
    def __init__(self, vocab_size, emb=300, hidden=256, num_classes=4, dropout=0.3):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb, padding_idx=PAD)
        self.lstm = nn.LSTM(emb, hidden, num_layers=2, batch_first=True, bidirectional=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(4 * hidden, num_classes)

    def forward(self, x, lengths):
        emb = self.drop(self.embedding(x))
        packed = nn.utils.rnn.pack_padded_sequence(emb, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        mask = (x != PAD).unsqueeze(-1)
        mean = (out * mask).sum(1) / mask.sum(1)
        mx = out.masked_fill(~mask, -1e4).max(1).values
        return self.fc(self.drop(torch.cat([mean, mx], dim=-1)))


def run_epoch_eval(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, lengths, y in loader:
            x, y = x.to(device), y.to(device)
            stats[0] += (model(x, lengths).argmax(-1) == y).sum()
            stats[1] += y.size(0)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def worker(rank, world_size, args, vocab, train_rows, test_rows):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_ds = NewsDataset(train_rows, vocab)
    test_ds = Subset(NewsDataset(test_rows, vocab), range(rank, len(test_rows), world_size))
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=2, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=512, collate_fn=collate, num_workers=2)

    model = BiLSTMClassifier(len(vocab)).to(device)
    model = DDP(model, device_ids=[rank])
    # args.batch_size is the global batch; each process gets an equal share
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)
        for step, (x, lengths, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x, lengths), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            total += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
        dist.all_reduce(total)
        acc = run_epoch_eval(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {(total[0] / total[1]).item():.4f}, test acc {acc:.4f}")
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "vocab": vocab}, args.save)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--test", required=True)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default="agnews_bilstm.pt")
    args = parser.parse_args()

    assert args.batch_size % args.gpus == 0, "global batch must divide evenly across GPUs"
    args.batch_size //= args.gpus
    args.port = free_port()

    train_rows, test_rows = read_csv(args.train), read_csv(args.test)
    vocab = build_vocab(train_rows)
    print(f"{len(train_rows)} train / {len(test_rows)} test, vocab {len(vocab)}, {args.gpus} GPUs")
    mp.spawn(worker, args=(args.gpus, args, vocab, train_rows, test_rows), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
