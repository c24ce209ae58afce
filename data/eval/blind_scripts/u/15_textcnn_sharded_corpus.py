"""TextCNN / fastText-style classifier on the Amazon-reviews polarity corpus (3.6M lines).

The csv is too big to hold N copies in host memory, so every rank only reads
its own stripe of lines.

    torchrun --nproc_per_node=4 15_textcnn_sharded_corpus.py --train data/amazon/train.csv --test data/amazon/test.csv
"""
import argparse
import csv
import os
import random
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

SPECIALS = ['<pad>', '<unk>']
PAD, UNK = 0, 1

args = None
rank = world = 0
device = None


def simple_tok(text):
    return text.lower().replace('.', ' . ').replace(',', ' , ').replace('!', ' ! ').split()


def read_stripe(path, stripe, n_stripes):
    """Read every n_stripes-th line starting at stripe, equal count for every stripe."""
    with open(path, newline='', encoding='utf-8') as f:
        n_lines = sum(1 for _ in f)
    usable = n_lines // n_stripes * n_stripes
    texts, labels = [], []
    with open(path, newline='', encoding='utf-8') as f:
        for i, row in enumerate(csv.reader(f)):
            if i >= usable:
                break
            if i % n_stripes != stripe:
                continue
            labels.append(int(row[0]) - 1)
            texts.append(simple_tok(row[1] + ' ' + row[2]))
    return texts, labels


def make_vocab(texts, min_freq):
    c = Counter(tok for t in texts for tok in t)
    itos = SPECIALS + sorted(w for w, n in c.items() if n >= min_freq)
    return {w: i for i, w in enumerate(itos)}


def encode(texts, vocab, max_len):
    out = torch.full((len(texts), max_len), PAD, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = [vocab.get(w, UNK) for w in t[:max_len]]
        if ids:
            out[i, :len(ids)] = torch.tensor(ids)
    return out


class TextCNN(nn.Module):
    def __init__(self, vocab_size, n_cls, emb=128, kernels=(3, 4, 5), ch=200, drop=0.5):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb, padding_idx=PAD)
        self.convs = nn.ModuleList([nn.Conv1d(emb, ch, k) for k in kernels])
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(ch * len(kernels), n_cls)

    def forward(self, x):
        e = self.emb(x).transpose(1, 2)
        h = torch.cat([F.relu(c(e)).max(-1)[0] for c in self.convs], 1)
        return self.fc(self.drop(h))


def batches(X, Y, bs, shuffle, seed):
    idx = list(range(len(Y)))
    if shuffle:
        random.Random(seed).shuffle(idx)
    for i in range(0, len(idx) - bs + 1, bs):
        j = torch.tensor(idx[i:i + bs])
        yield X[j], Y[j]


def evaluate(model, X, Y):
    model.eval()
    s = torch.zeros(2, device=device)
    with torch.no_grad():
        for i in range(0, len(Y), 1024):
            x, y = X[i:i + 1024].to(device), Y[i:i + 1024].to(device)
            s[0] += (model(x).argmax(1) == y).sum()
            s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    global args, rank, world, device
    ap = argparse.ArgumentParser()
    ap.add_argument('--train', required=True)
    ap.add_argument('--test', required=True)
    ap.add_argument('--max_len', type=int, default=256)
    ap.add_argument('--min_freq', type=int, default=5)
    ap.add_argument('--bs', type=int, default=128)
    ap.add_argument('--lr', type=float, default=1e-3)
    ap.add_argument('--epochs', type=int, default=5)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--out', default='runs/textcnn_amazon')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    torch.manual_seed(args.seed)

    t0 = time.time()
    tr_texts, tr_labels = read_stripe(args.train, rank, world)
    vocab = make_vocab(tr_texts, args.min_freq)
    Xtr, Ytr = encode(tr_texts, vocab, args.max_len), torch.tensor(tr_labels)
    del tr_texts
    te_texts, te_labels = read_stripe(args.test, rank, world)
    Xte, Yte = encode(te_texts, vocab, args.max_len), torch.tensor(te_labels)
    del te_texts
    n_cls = 2
    print(f'[rank {rank}] {len(Ytr)} train / {len(Yte)} test lines, vocab {len(vocab)}, {time.time() - t0:.0f}s',
          flush=True)

    model = TextCNN(len(vocab), n_cls).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps_per_epoch = len(Ytr) // args.bs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)

    writer = SummaryWriter(args.out) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros(2, device=device)
        # a different order on every rank and every epoch
        for x, y in batches(Xtr, Ytr, args.bs, True, args.seed + 1000 * epoch + rank):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if writer is not None and step % 200 == 0:
                writer.add_scalar('train/loss', loss.item(), step)
        dist.all_reduce(running)
        acc = evaluate(model.module, Xte, Yte)
        if rank == 0:
            print(f'epoch {epoch}: train loss {(running[0] / running[1]).item():.4f}  test acc {acc:.4f}')
            writer.add_scalar('test/acc', acc, epoch)
            os.makedirs(args.out, exist_ok=True)
            torch.save({'model': model.module.state_dict(), 'vocab': vocab, 'epoch': epoch},
                       os.path.join(args.out, 'checkpoint.pt'))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
