"""
Tiny Transformer encoder for AG News topic classification, trained with DDP.

    torchrun --nproc_per_node=2 06_tiny_transformer_agnews.py --epochs 5

4 classes: World, Sports, Business, Sci/Tech.
Tokenizer is a simple regex word tokenizer, vocab = most frequent words in train.
"""
import os
import re
import math
import time
import argparse
from collections import Counter

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from datasets import load_dataset

PAD, UNK = 0, 1
TOKEN_RE = re.compile(r"[a-z0-9']+")


def tokenize(text):
    return TOKEN_RE.findall(text.lower())


def build_vocab(texts, max_size):
    counter = Counter()
    for t in texts:
        counter.update(tokenize(t))
    # sort by count, then alphabetically -> same vocab on every rank
    words = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[: max_size - 2]
    vocab = {"<pad>": PAD, "<unk>": UNK}
    for w, _ in words:
        vocab[w] = len(vocab)
    return vocab


class NewsDataset(Dataset):
    def __init__(self, hf_split, vocab, max_len):
        self.texts = hf_split["text"]
        self.labels = hf_split["label"]
        self.vocab = vocab
        self.max_len = max_len

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        ids = [self.vocab.get(w, UNK) for w in tokenize(self.texts[idx])][: self.max_len]
        ids = ids + [PAD] * (self.max_len - len(ids))
        return torch.tensor(ids, dtype=torch.long), torch.tensor(self.labels[idx], dtype=torch.long)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=512):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class TransformerClassifier(nn.Module):
    def __init__(self, vocab_size, d_model=128, nhead=4, num_layers=2, num_classes=4, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos = PositionalEncoding(d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model,
                                           dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers)
        self.head = nn.Linear(d_model, num_classes)
        self.d_model = d_model

    def forward(self, ids):
        mask = ids.eq(PAD)
        x = self.pos(self.embed(ids) * math.sqrt(self.d_model))
        x = self.encoder(x, src_key_padding_mask=mask)
        # mean pooling over the non-pad tokens
        keep = (~mask).unsqueeze(-1).float()
        x = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(x)

    @torch.no_grad()
    def predict(self, ids):
        return self.forward(ids).argmax(dim=-1)


def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for ids, labels in loader:
        ids, labels = ids.to(device), labels.to(device)
        preds = model.predict(ids)
        correct += (preds == labels).sum()
        count += labels.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--vocab_size", type=int, default=30000)
    ap.add_argument("--out_dir", default="runs/agnews")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    # let rank 0 download / build the HF cache first
    if rank != 0:
        dist.barrier()
    ds = load_dataset("ag_news")
    if rank == 0:
        dist.barrier()

    vocab = build_vocab(ds["train"]["text"], args.vocab_size)
    if rank == 0:
        print(f"vocab size: {len(vocab)}, train: {len(ds['train'])}, test: {len(ds['test'])}")

    train_ds = NewsDataset(ds["train"], vocab, args.max_len)
    test_ds = NewsDataset(ds["test"], vocab, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2)
    test_dl = DataLoader(test_ds, batch_size=256, sampler=test_sampler, num_workers=2)

    model = TransformerClassifier(len(vocab)).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.1)
    loss_fn = nn.CrossEntropyLoss()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, labels in train_dl:
            ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            logits = model(ids)
            loss = loss_fn(logits, labels)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step}/{total_steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")

        acc = evaluate(model, test_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: test acc {acc * 100:.2f}%  ({time.time() - t0:.0f}s)")
            torch.save({"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch},
                       os.path.join(args.out_dir, "model.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
