"""
Sentiment classification on IMDB (aclImdb folder layout) with a small Transformer encoder.
Spawns one process per GPU.

    python 06_imdb_transformer_cls.py --data aclImdb --nprocs 4 --accum 2
"""
import argparse
import contextlib
import glob
import os
import re
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler

PAD, UNK = 0, 1
TOKEN_RE = re.compile(r"[a-z0-9']+")


def tokenize(text):
    return TOKEN_RE.findall(text.lower().replace("<br />", " "))


def read_split(root, split):
    texts, labels = [], []
    for label, sub in enumerate(["neg", "pos"]):
        for fn in sorted(glob.glob(os.path.join(root, split, sub, "*.txt"))):
            with open(fn, encoding="utf-8") as f:
                texts.append(f.read())
            labels.append(label)
    return texts, labels


def build_or_load_vocab(root, cache_path, max_size, rank):
    # only rank 0 builds the vocab; the others wait and read the finished file
    if rank == 0 and not os.path.exists(cache_path):
        texts, _ = read_split(root, "train")
        counter = Counter(tok for t in texts for tok in tokenize(t))
        itos = ["<pad>", "<unk>"] + [w for w, _ in counter.most_common(max_size - 2)]
        tmp = cache_path + ".tmp"
        torch.save(itos, tmp)
        os.replace(tmp, cache_path)
    dist.barrier()
    itos = torch.load(cache_path)
    return {w: i for i, w in enumerate(itos)}


class IMDBDataset(Dataset):
    def __init__(self, texts, labels, stoi, max_len):
        self.texts, self.labels = texts, labels
        self.stoi, self.max_len = stoi, max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        ids = [self.stoi.get(t, UNK) for t in tokenize(self.texts[i])][: self.max_len]
        return torch.tensor(ids, dtype=torch.long), self.labels[i]


def collate(batch):
    seqs, labels = zip(*batch)
    lengths = torch.tensor([len(s) for s in seqs])
    padded = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    return padded, lengths, torch.tensor(labels)


class TransformerClassifier(nn.Module):
    def __init__(self, vocab_size, d_model=256, nhead=4, layers=4, max_len=512, n_classes=2):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        enc_layer = nn.TransformerEncoderLayer(d_model, nhead, 4 * d_model, dropout=0.1,
                                               batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, n_classes)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x):
        pad_mask = x.eq(PAD)
        h = self.emb(x) + self.pos[:, : x.size(1)]
        h = self.encoder(h, src_key_padding_mask=pad_mask)
        h = h.masked_fill(pad_mask.unsqueeze(-1), 0.0)
        pooled = h.sum(1) / (~pad_mask).sum(1, keepdim=True).clamp(min=1)
        return self.fc(self.norm(pooled))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, _, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        s[0] += F.cross_entropy(logits, y, reduction="sum")
        s[1] += (logits.argmax(-1) == y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def run(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    stoi = build_or_load_vocab(args.data, args.vocab_cache, args.vocab_size, rank)
    texts, labels = read_split(args.data, "train")
    full = IMDBDataset(texts, labels, stoi, args.max_len)
    n_val = int(len(full) * 0.1)
    # same generator seed on every rank -> identical split everywhere
    g = torch.Generator().manual_seed(args.seed)
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val], generator=g)
    torch.manual_seed(args.seed + rank)  # dropout streams may differ per rank

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, collate_fn=collate, num_workers=2)

    torch.manual_seed(args.seed)  # identical init on every rank (DDP also broadcasts from rank 0)
    model = TransformerClassifier(len(stoi), max_len=args.max_len).to(device)
    model = DDP(model, device_ids=[rank])

    global_batch = args.batch_size * args.accum * world_size
    lr = args.lr * global_batch / 32
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = args.epochs * (len(train_loader) // args.accum)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        n_batches = (len(train_loader) // args.accum) * args.accum
        for i, (x, _, y) in enumerate(train_loader):
            if i >= n_batches:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                loss = F.cross_entropy(model(x), y) / args.accum
                loss.backward()
            if sync_now:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

        val_loss, val_acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val_loss={val_loss:.4f} val_acc={val_acc:.4f}")
            if val_acc > best:
                best = val_acc
                torch.save({"model": model.module.state_dict(), "vocab_cache": args.vocab_cache},
                           args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="aclImdb")
    p.add_argument("--vocab-cache", default="imdb_vocab.pt")
    p.add_argument("--vocab-size", type=int, default=30000)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--nprocs", type=int, default=torch.cuda.device_count())
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 32")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--out", default="imdb_transformer.pt")
    args = p.parse_args()
    mp.spawn(run, args=(args.nprocs, args), nprocs=args.nprocs, join=True)
