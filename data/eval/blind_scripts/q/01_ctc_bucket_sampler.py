#!/usr/bin/env python
# CTC acoustic model training (BLSTM over fbank), multi-GPU with torchrun.
# Features are precomputed .npy (80-dim fbank); manifests are tsv: utt_id \t feat_path \t n_frames \t text
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-tsv", required=True)
    p.add_argument("--valid-tsv", required=True)
    p.add_argument("--save-dir", default="exp/ctc_blstm")
    p.add_argument("--max-frames", type=int, default=20000, help="frames per batch per GPU")
    p.add_argument("--max-epoch", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-norm", type=float, default=5.0)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=50)
    return p.parse_args()


def read_tsv(path):
    items = []
    with open(path) as f:
        for line in f:
            utt, feat, n, text = line.rstrip("\n").split("\t")
            items.append((utt, feat, int(n), text))
    return items


class CharVocab:
    def __init__(self, texts):
        chars = sorted(set("".join(texts)))
        self.itos = ["<blank>"] + chars
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def encode(self, s):
        return [self.stoi[c] for c in s if c in self.stoi]

    def decode(self, ids):
        return "".join(self.itos[i] for i in ids)

    def __len__(self):
        return len(self.itos)


class FbankDataset(Dataset):
    def __init__(self, items, vocab):
        self.items = items
        self.vocab = vocab

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        utt, feat, n, text = self.items[i]
        x = torch.from_numpy(np.load(feat)).float()
        # utterance-level CMVN
        x = (x - x.mean(0, keepdim=True)) / (x.std(0, keepdim=True) + 1e-5)
        y = torch.tensor(self.vocab.encode(text), dtype=torch.long)
        return x, y


def collate(batch):
    xs, ys = zip(*batch)
    xl = torch.tensor([x.size(0) for x in xs])
    yl = torch.tensor([y.size(0) for y in ys])
    X = nn.utils.rnn.pad_sequence(xs, batch_first=True)
    Y = nn.utils.rnn.pad_sequence(ys, batch_first=True)
    return X, xl, Y, yl


class DistributedBucketBatchSampler(Sampler):
    """Sort by length, cut into batches of at most max_frames, shuffle batches, shard across ranks."""

    def __init__(self, lengths, max_frames, num_replicas, rank, shuffle=True, seed=0, pad=True):
        self.lengths = lengths
        self.pad = pad
        self.max_frames = max_frames
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        self.batches = []
        cur, cur_max = [], 0
        for i in order:
            m = max(cur_max, lengths[i])
            if cur and m * (len(cur) + 1) > max_frames:
                self.batches.append(cur)
                cur, cur_max = [], 0
                m = lengths[i]
            cur.append(i)
            cur_max = m
        if cur:
            self.batches.append(cur)
        self.num_batches = int(math.ceil(len(self.batches) / num_replicas))

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        batches = list(self.batches)
        if self.shuffle:
            rng = random.Random(self.seed + self.epoch)
            rng.shuffle(batches)
        if not self.pad:
            # eval: no duplicated batches, ranks may get one batch less
            return iter(batches[self.rank::self.num_replicas])
        total = self.num_batches * self.num_replicas
        batches += batches[: total - len(batches)]
        return iter(batches[self.rank:total:self.num_replicas])

    def __len__(self):
        if not self.pad:
            return len(self.batches[self.rank::self.num_replicas])
        return self.num_batches


class BLSTMCTC(nn.Module):
    def __init__(self, idim, hidden, layers, odim):
        super().__init__()
        # 4x time subsampling
        self.conv = nn.Sequential(
            nn.Conv1d(idim, hidden, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(hidden, hidden, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.rnn = nn.LSTM(hidden, hidden, num_layers=layers, bidirectional=True,
                           batch_first=True, dropout=0.2)
        self.out = nn.Linear(2 * hidden, odim)

    def forward(self, x, xl):
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        xl = ((xl + 1) // 2 + 1) // 2
        xl = xl.clamp(max=x.size(1))
        packed = nn.utils.rnn.pack_padded_sequence(x, xl.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.rnn(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.size(1))
        return self.out(h).log_softmax(-1), xl


def edit_distance(a, b):
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(b)]


def greedy_decode(logp, lens):
    hyps = []
    best = logp.argmax(-1).cpu()
    for b in range(best.size(0)):
        seq, prev = [], 0
        for t in best[b, : lens[b]].tolist():
            if t != prev and t != 0:
                seq.append(t)
            prev = t
        hyps.append(seq)
    return hyps


@torch.no_grad()
def validate(model, loader, vocab, device):
    model.eval()
    stats = torch.zeros(4, device=device)  # loss_sum, n_utts, word_errs, n_words
    for X, xl, Y, yl in loader:
        X, Y = X.to(device), Y.to(device)
        logp, ol = model(X, xl.to(device))
        loss = F.ctc_loss(logp.transpose(0, 1), Y, ol, yl.to(device), zero_infinity=True, reduction="sum")
        stats[0] += loss
        stats[1] += X.size(0)
        for b, hyp in enumerate(greedy_decode(logp, ol.tolist())):
            ref = vocab.decode(Y[b, : yl[b]].tolist()).split()
            stats[2] += edit_distance(ref, vocab.decode(hyp).split())
            stats[3] += len(ref)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item(), (100.0 * stats[2] / stats[3].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_items = read_tsv(args.train_tsv)
    valid_items = read_tsv(args.valid_tsv)
    vocab = CharVocab([t for _, _, _, t in train_items])

    train_ds = FbankDataset(train_items, vocab)
    valid_ds = FbankDataset(valid_items, vocab)
    train_sampler = DistributedBucketBatchSampler([n for _, _, n, _ in train_items], args.max_frames,
                                                  world, rank, shuffle=True, seed=args.seed)
    valid_sampler = DistributedBucketBatchSampler([n for _, _, n, _ in valid_items], args.max_frames,
                                                  world, rank, shuffle=False, pad=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_sampler=valid_sampler, collate_fn=collate,
                              num_workers=args.num_workers)

    model = BLSTMCTC(80, args.hidden, args.layers, len(vocab)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=1)

    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "tb"))
        print(f"vocab={len(vocab)} train_utts={len(train_ds)} batches/rank={len(train_sampler)}")

    best_wer = float("inf")
    step = 0
    for epoch in range(1, args.max_epoch + 1):
        model.train()
        t0 = time.time()
        for X, xl, Y, yl in train_loader:
            X, Y = X.to(device, non_blocking=True), Y.to(device, non_blocking=True)
            logp, ol = model(X, xl.to(device))
            loss = F.ctc_loss(logp.transpose(0, 1), Y, ol, yl.to(device), zero_infinity=True)
            optimizer.zero_grad()
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            if math.isfinite(gnorm.item()):
                optimizer.step()
            step += 1
            if rank == 0 and step % args.log_interval == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/gnorm", gnorm.item(), step)
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")

        vloss, wer = validate(model.module, valid_loader, vocab, device)
        scheduler.step(vloss)
        if rank == 0:
            writer.add_scalar("valid/loss", vloss, epoch)
            writer.add_scalar("valid/wer", wer, epoch)
            print(f"| epoch {epoch} valid loss {vloss:.3f} wer {wer:.2f}")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "vocab": vocab.itos}
            torch.save(state, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(state, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
        print(f"done, best wer {best_wer:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
