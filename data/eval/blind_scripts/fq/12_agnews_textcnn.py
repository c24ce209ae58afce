"""
AG News topic classification with a Kim-style TextCNN over pretrained-free embeddings.
Data: train.csv / test.csv from the Kaggle "AG News Classification Dataset"
(columns: Class Index, Title, Description).

    python 12_agnews_textcnn.py --gpus 2 --epochs 8
"""
import argparse
import os
import re
import time
from collections import Counter

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TOK = re.compile(r"\w+|[^\w\s]")


def tokenize(s):
    return TOK.findall(s.lower())


def build_vocab(texts, min_freq=2, max_size=50000):
    cnt = Counter()
    for t in texts:
        cnt.update(tokenize(t))
    words = [w for w, c in cnt.most_common(max_size) if c >= min_freq]
    return {w: i + 2 for i, w in enumerate(words)}  # 0 pad, 1 unk


class AGNews(Dataset):
    def __init__(self, df, vocab, max_len=120):
        self.texts = (df["Title"] + " " + df["Description"]).tolist()
        self.labels = (df["Class Index"] - 1).tolist()
        self.vocab, self.max_len = vocab, max_len

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        ids = [self.vocab.get(w, 1) for w in tokenize(self.texts[i])][: self.max_len]
        ids = ids + [0] * (self.max_len - len(ids))
        return torch.tensor(ids), self.labels[i]


class TextCNN(nn.Module):
    def __init__(self, vocab_size, emb_dim=300, n_filters=256, sizes=(3, 4, 5), n_classes=4, dropout=0.5):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(emb_dim, n_filters, k) for k in sizes])
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(n_filters * len(sizes), n_classes)

    def forward(self, x):
        e = self.emb(x).transpose(1, 2)
        pooled = [F.relu(c(e)).max(dim=2).values for c in self.convs]
        return self.fc(self.dropout(torch.cat(pooled, 1)))


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29560"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            total += y.size(0)
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    loss_sum, correct, total = stats.tolist()
    return loss_sum / total, correct / total


def main_worker(rank, world_size, args):
    setup(rank, world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_df = pd.read_csv(os.path.join(args.data, "train.csv"))
    test_df = pd.read_csv(os.path.join(args.data, "test.csv"))
    # deterministic: every rank builds the identical vocab from the full train csv
    vocab = build_vocab((train_df["Title"] + " " + train_df["Description"]).tolist())
    train_ds, test_ds = AGNews(train_df, vocab), AGNews(test_df, vocab)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=512, sampler=test_sampler, num_workers=4)

    model = TextCNN(len(vocab) + 2).to(device)
    model = DDP(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.3)

    if rank == 0:
        print(f"vocab={len(vocab)} train={len(train_ds)} test={len(test_ds)} world={world_size}")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            optimizer.step()
            if rank == 0 and step % 200 == 0:
                print(f"  ep {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}")
        scheduler.step()

        test_loss, test_acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: test_loss {test_loss:.4f} test_acc {test_acc:.4f} "
                  f"({time.time() - t0:.0f}s)")
            if test_acc > best:
                best = test_acc
                torch.save({"state_dict": model.module.state_dict(), "vocab": vocab},
                           os.path.join(args.out, "textcnn_agnews.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./ag_news")
    ap.add_argument("--out", default=".")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    mp.spawn(main_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
