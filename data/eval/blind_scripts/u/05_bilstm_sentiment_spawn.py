"""BiLSTM + attention sentiment classifier (IMDB / Yelp-5 style tsv), multi-GPU via mp.spawn.

python 05_bilstm_sentiment_spawn.py --train data/yelp5/train.tsv --dev data/yelp5/dev.tsv --gpus 4
"""
import os
import re
import json
import time
import argparse
from collections import Counter

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

PAD, UNK = 0, 1
TOKEN_RE = re.compile(r"[a-z0-9']+|[!?.,]")


def tokenize(s):
    return TOKEN_RE.findall(s.lower())


def read_tsv(path):
    texts, labels = [], []
    with open(path, encoding='utf-8') as f:
        for line in f:
            lab, txt = line.rstrip('\n').split('\t', 1)
            texts.append(tokenize(txt))
            labels.append(int(lab))
    return texts, labels


def build_vocab(texts, max_size=50000, min_freq=3):
    cnt = Counter(w for t in texts for w in t)
    itos = ['<pad>', '<unk>'] + [w for w, c in cnt.most_common(max_size) if c >= min_freq]
    return {w: i for i, w in enumerate(itos)}


class TextDS(Dataset):
    def __init__(self, texts, labels, vocab, max_len=400):
        self.x = [[vocab.get(w, UNK) for w in t[:max_len]] or [UNK] for t in texts]
        self.y = labels

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def collate(batch):
    lens = torch.tensor([len(x) for x, _ in batch])
    xs = torch.full((len(batch), int(lens.max())), PAD, dtype=torch.long)
    for i, (x, _) in enumerate(batch):
        xs[i, :len(x)] = torch.tensor(x)
    ys = torch.tensor([y for _, y in batch])
    return xs, lens, ys


class AttnBiLSTM(nn.Module):
    def __init__(self, vocab_size, n_cls, emb=300, hid=256, layers=2, drop=0.3):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb, padding_idx=PAD)
        self.lstm = nn.LSTM(emb, hid, num_layers=layers, bidirectional=True, batch_first=True, dropout=drop)
        self.att = nn.Linear(2 * hid, 1)
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(2 * hid, n_cls)

    def forward(self, x, lens):
        e = self.drop(self.emb(x))
        packed = pack_padded_sequence(e, lens.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
        scores = self.att(out).squeeze(-1).masked_fill(x == PAD, -1e4)
        w = torch.softmax(scores, dim=1).unsqueeze(-1)
        return self.fc(self.drop((out * w).sum(1)))


def run_eval(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    crit = nn.CrossEntropyLoss(reduction='sum')
    with torch.no_grad():
        for x, lens, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x, lens)
            stats[0] += crit(logits, y)
            stats[1] += (logits.argmax(-1) == y).sum()
            stats[2] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def train_worker(rank, args, world_size):
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', rank=rank, world_size=world_size)
    device = torch.device('cuda', rank)
    torch.manual_seed(args.seed)

    # vocab is built once by the launcher and read from disk by everyone
    with open(os.path.join(args.out, 'vocab.json')) as f:
        vocab = json.load(f)
    tr_x, tr_y = read_tsv(args.train)
    dv_x, dv_y = read_tsv(args.dev)
    n_cls = max(tr_y) + 1
    train_ds = TextDS(tr_x, tr_y, vocab, args.max_len)
    dev_ds = TextDS(dv_x, dv_y, vocab, args.max_len)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    # plain strided shard for dev (no padding -> every example counted exactly once)
    dev_shard = Subset(dev_ds, list(range(rank, len(dev_ds), world_size)))
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    dev_dl = DataLoader(dev_shard, batch_size=256, shuffle=False, collate_fn=collate, num_workers=2)

    model = AttnBiLSTM(len(vocab), n_cls, hid=args.hidden).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world_size ** 0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    crit = nn.CrossEntropyLoss()

    writer = SummaryWriter(os.path.join(args.out, 'tb')) if rank == 0 else None
    best = 0.
    gstep = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, lens, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(x, lens), y)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            gstep += 1
            if rank == 0 and gstep % 100 == 0:
                writer.add_scalar('train/loss', loss.item(), gstep)
        sched.step()
        dev_loss, dev_acc = run_eval(model.module, dev_dl, device)
        if rank == 0:
            print(f'epoch {epoch} dev_loss {dev_loss:.4f} dev_acc {dev_acc:.4f} time {time.time() - t0:.0f}s')
            writer.add_scalar('dev/loss', dev_loss, epoch)
            writer.add_scalar('dev/acc', dev_acc, epoch)
            if dev_acc > best:
                best = dev_acc
                torch.save({'model': model.module.state_dict(), 'vocab_size': len(vocab), 'n_cls': n_cls,
                            'epoch': epoch, 'dev_acc': dev_acc}, os.path.join(args.out, 'best.pt'))
    if rank == 0:
        print('best dev acc', best)
        writer.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--train', required=True)
    ap.add_argument('--dev', required=True)
    ap.add_argument('--out', default='out/bilstm')
    ap.add_argument('--gpus', type=int, default=torch.cuda.device_count())
    ap.add_argument('--epochs', type=int, default=10)
    ap.add_argument('--bs', type=int, default=64)
    ap.add_argument('--lr', type=float, default=1e-3)
    ap.add_argument('--hidden', type=int, default=256)
    ap.add_argument('--max_len', type=int, default=400)
    ap.add_argument('--seed', type=int, default=42)
    ap.add_argument('--port', type=int, default=29533)
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    texts, _ = read_tsv(args.train)
    vocab = build_vocab(texts)
    with open(os.path.join(args.out, 'vocab.json'), 'w') as f:
        json.dump(vocab, f)
    print(f'vocab size {len(vocab)}, spawning {args.gpus} workers')
    del texts

    mp.spawn(train_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == '__main__':
    main()
