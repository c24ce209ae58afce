"""Puigcerver-style CNN + 5xBLSTM CTC recognizer for the READ 2016 (Ratsprotokolle) lines.

Gradient accumulation keeps the effective batch at 64 lines whatever the number of GPUs.

    torchrun --nproc_per_node=4 12_puigcerver_htr_read2016.py --manifest-dir data/read2016 --out runs/read16
"""
import argparse
import csv
import logging
import math
import os
from contextlib import nullcontext

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest-dir", required=True, help="train.csv / val.csv with columns image,text")
    ap.add_argument("--out", default="runs/read16")
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--patience", type=int, default=20)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def read_manifest(path):
    with open(path, encoding="utf-8", newline="") as f:
        return [(r["image"], r["text"]) for r in csv.DictReader(f)]


class Lines(Dataset):
    def __init__(self, rows, root, vocab, height, train):
        self.rows, self.root, self.height, self.train = rows, root, height, train
        self.stoi = {c: i + 1 for i, c in enumerate(vocab)}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        im = Image.open(os.path.join(self.root, path)).convert("L")
        w = max(32, int(im.width * self.height / im.height))
        im = im.resize((w, self.height), Image.BICUBIC)
        a = 1.0 - np.asarray(im, dtype=np.float32) / 255.0
        if self.train and np.random.rand() < 0.5:
            a = np.clip(a * np.random.uniform(0.7, 1.2), 0, 1)
        return torch.from_numpy(a)[None], torch.tensor([self.stoi[c] for c in text if c in self.stoi]), text


def collate(batch):
    xs, ys, texts = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    W = (W + 7) // 8 * 8
    imgs = torch.zeros(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        imgs[i, :, :, : x.shape[-1]] = x
    return imgs, torch.tensor([x.shape[-1] for x in xs]), torch.cat(ys), torch.tensor([len(y) for y in ys]), texts


class Puigcerver(nn.Module):
    def __init__(self, n_out, height=128):
        super().__init__()
        chans, layers, cin = [16, 32, 48, 64, 80], [], 1
        for i, c in enumerate(chans):
            layers += [nn.Conv2d(cin, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.LeakyReLU(0.01, inplace=True)]
            if i < 3:
                layers.append(nn.MaxPool2d(2))
            if i >= 2:
                layers.append(nn.Dropout2d(0.2))
            cin = c
        self.conv = nn.Sequential(*layers)
        self.blstm = nn.LSTM(80 * (height // 8), 256, num_layers=5, bidirectional=True, dropout=0.5)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(512, n_out)

    def forward(self, x):
        f = self.conv(x)
        b, c, h, w = f.shape
        f = f.permute(3, 0, 1, 2).reshape(w, b, c * h)
        f, _ = self.blstm(f)
        return self.fc(self.drop(f))


def greedy(log_probs, lengths, vocab):
    out = []
    for b, seq in enumerate(log_probs.argmax(-1).t().tolist()):
        prev, s = 0, []
        for k in seq[: lengths[b]]:
            if k and k != prev:
                s.append(vocab[k - 1])
            prev = k
        out.append("".join(s))
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(1)

    accum = max(1, args.global_batch // (args.micro_batch * world))
    logger.info("world %d, micro batch %d, accumulation %d -> global batch %d",
                world, args.micro_batch, accum, args.micro_batch * world * accum)

    train_rows = read_manifest(os.path.join(args.manifest_dir, "train.csv"))
    val_rows = read_manifest(os.path.join(args.manifest_dir, "val.csv"))
    vocab = sorted({c for _, t in train_rows for c in t})
    img_root = os.path.join(args.manifest_dir, "images")
    train_ds = Lines(train_rows, img_root, vocab, args.height, train=True)
    val_ds = Subset(Lines(val_rows, img_root, vocab, args.height, train=False), range(rank, len(val_rows), world))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + w) % 2**32))
    val_loader = DataLoader(val_ds, batch_size=16, collate_fn=collate, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Puigcerver(len(vocab) + 1, args.height)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.RMSprop(model.parameters(), lr=args.lr)
    ctc = nn.CTCLoss(zero_infinity=True, reduction="sum")

    best_cer, bad_epochs = math.inf, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        n_micro = len(train_loader) - len(train_loader) % accum
        for i, (x, widths, y, ylen, _) in enumerate(train_loader):
            if i >= n_micro:
                break
            x = x.to(device, non_blocking=True)
            sync_now = (i + 1) % accum == 0
            with (nullcontext() if sync_now else model.no_sync()):
                lp = model(x).log_softmax(-1)
                xlen = (widths // 8).clamp(max=lp.shape[0]).to(device)
                loss = ctc(lp, y.to(device), xlen, ylen.to(device)) / (x.shape[0] * accum)
                loss.backward()
            if sync_now:
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optim.step()
                optim.zero_grad(set_to_none=True)
            if i % (50 * accum) == 0:
                logger.info("epoch %d iter %d/%d loss %.4f", epoch, i, n_micro, loss.item() * accum)

        model.eval()
        ce = cn = we = wn = 0
        with torch.no_grad():
            for x, widths, _, _, texts in val_loader:
                lp = model.module(x.to(device)).log_softmax(-1)
                lengths = (widths // 8).clamp(max=lp.shape[0]).tolist()
                for p, g in zip(greedy(lp, lengths, vocab), texts):
                    ce += editdistance.eval(p, g)
                    cn += len(g)
                    we += editdistance.eval(p.split(), g.split())
                    wn += len(g.split())
        totals = torch.tensor([ce, cn, we, wn], dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        cer, wer = (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()
        logger.info("epoch %d: val CER %.4f WER %.4f", epoch, cer, wer)

        improved = cer < best_cer
        if improved:
            best_cer, bad_epochs = cer, 0
        else:
            bad_epochs += 1
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            ck = {"model": model.module.state_dict(), "optim": optim.state_dict(), "vocab": vocab,
                  "epoch": epoch, "cer": cer}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if improved:
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()
        if bad_epochs >= args.patience:
            logger.info("no improvement for %d epochs, stopping", args.patience)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
