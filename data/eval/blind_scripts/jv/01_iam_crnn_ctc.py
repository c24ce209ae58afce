#!/usr/bin/env python
"""CRNN + CTC handwritten line recognition on IAM (Aachen writer-disjoint split).

Distributed data-parallel training, one process per GPU:

    torchrun --nproc_per_node=4 01_iam_crnn_ctc.py --data-root /data/IAM --out runs/crnn
"""
import argparse
import logging
import math
import os
import random
import time
from dataclasses import dataclass

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("crnn")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--split-dir", default=None, help="folder with trainset.txt / validationset1.txt")
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--max-width", type=int, default=1600)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--out", default="runs/crnn")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


@dataclass
class LineSample:
    line_id: str
    path: str
    text: str


def read_iam_lines(root, ids):
    wanted = set(ids)
    samples = []
    with open(os.path.join(root, "ascii", "lines.txt")) as f:
        for raw in f:
            if raw.startswith("#"):
                continue
            parts = raw.strip().split(" ")
            if len(parts) < 9 or parts[0] not in wanted:
                continue
            if parts[1] != "ok":
                continue
            line_id = parts[0]
            form = "-".join(line_id.split("-")[:2])
            path = os.path.join(root, "lines", line_id.split("-")[0], form, line_id + ".png")
            text = " ".join(parts[8:]).replace("|", " ")
            samples.append(LineSample(line_id, path, text))
    return samples


def read_split(split_dir, name):
    with open(os.path.join(split_dir, name)) as f:
        return [l.strip() for l in f if l.strip()]


def build_charset(samples):
    chars = set()
    for s in samples:
        chars.update(s.text)
    return list(chars)


class IAMLines(Dataset):
    def __init__(self, samples, charset, height, max_width, train):
        self.samples = samples
        self.char2idx = {c: i + 1 for i, c in enumerate(charset)}  # 0 is the CTC blank
        self.height = height
        self.max_width = max_width
        self.train = train

    def __len__(self):
        return len(self.samples)

    def encode(self, text):
        return [self.char2idx[c] for c in text if c in self.char2idx]

    def __getitem__(self, idx):
        s = self.samples[idx]
        img = Image.open(s.path).convert("L")
        w, h = img.size
        scale = self.height / h
        if self.train:
            scale *= random.uniform(0.85, 1.15)  # horizontal stretch only
        new_w = int(min(self.max_width, max(32, round(w * scale))))
        img = img.resize((new_w, self.height), Image.BILINEAR)
        x = 1.0 - torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
        return x.unsqueeze(0), torch.tensor(self.encode(s.text), dtype=torch.long), s.text


def collate(batch):
    imgs, targets, texts = zip(*batch)
    max_w = max(i.shape[-1] for i in imgs)
    max_w = int(math.ceil(max_w / 4) * 4)
    out = torch.zeros(len(imgs), 1, imgs[0].shape[1], max_w)
    widths = torch.zeros(len(imgs), dtype=torch.long)
    for i, im in enumerate(imgs):
        out[i, :, :, : im.shape[-1]] = im
        widths[i] = im.shape[-1]
    target_lengths = torch.tensor([len(t) for t in targets], dtype=torch.long)
    return out, torch.cat(targets), target_lengths, widths, list(texts)


class CRNN(nn.Module):
    def __init__(self, num_classes, height=64, hidden=256):
        super().__init__()

        def block(cin, cout, pool):
            layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            if pool:
                layers.append(nn.MaxPool2d(pool))
            return layers

        self.cnn = nn.Sequential(
            *block(1, 64, (2, 2)),
            *block(64, 128, (2, 2)),
            *block(128, 256, None),
            *block(256, 256, (2, 1)),
            *block(256, 512, None),
            *block(512, 512, (2, 1)),
        )
        feat_h = height // 16
        self.proj = nn.Linear(512 * feat_h, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=2, bidirectional=True, dropout=0.25)
        self.head = nn.Linear(2 * hidden, num_classes)

    def forward(self, x):
        f = self.cnn(x)  # B, C, H', W/4
        b, c, h, w = f.shape
        f = f.permute(3, 0, 1, 2).reshape(w, b, c * h)
        f = self.proj(f)
        f, _ = self.rnn(f)
        return self.head(f)  # T, B, C


def greedy_decode(logits, widths, charset):
    best = logits.argmax(-1).t().cpu().numpy()
    out = []
    for b, seq in enumerate(best):
        t_len = int(widths[b]) // 4
        prev, chars = 0, []
        for k in seq[:t_len]:
            if k != prev and k != 0:
                chars.append(charset[k - 1])
            prev = k
        out.append("".join(chars))
    return out


@torch.no_grad()
def evaluate(model, loader, charset, device):
    model.eval()
    char_err = char_tot = word_err = word_tot = 0
    for imgs, _, _, widths, texts in loader:
        logits = model(imgs.to(device, non_blocking=True)).float()
        for pred, gt in zip(greedy_decode(logits, widths, charset), texts):
            char_err += editdistance.eval(pred, gt)
            char_tot += len(gt)
            word_err += editdistance.eval(pred.split(), gt.split())
            word_tot += len(gt.split())
    model.train()
    return char_err / max(1, char_tot), word_err / max(1, word_tot)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    split_dir = args.split_dir or os.path.join(args.data_root, "splits")
    train_samples = read_iam_lines(args.data_root, read_split(split_dir, "trainset.txt"))
    val_samples = read_iam_lines(args.data_root, read_split(split_dir, "validationset1.txt"))
    charset = build_charset(train_samples)
    log.info("train %d lines, val %d lines, %d symbols", len(train_samples), len(val_samples), len(charset))

    train_ds = IAMLines(train_samples, charset, args.height, args.max_width, train=True)
    val_ds = IAMLines(val_samples, charset, args.height, args.max_width, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=32, shuffle=False, num_workers=args.workers, collate_fn=collate)

    model = CRNN(len(charset) + 1, height=args.height)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * math.sqrt(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=steps_per_epoch, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    os.makedirs(args.out, exist_ok=True)
    best_cer = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(1, device=device)
        for step, (imgs, targets, target_lengths, widths, _) in enumerate(train_loader):
            imgs = imgs.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits = model(imgs)
            log_probs = F.log_softmax(logits.float(), dim=-1)
            input_lengths = torch.clamp(widths // 4, max=log_probs.shape[0])
            loss = ctc(log_probs, targets, input_lengths, target_lengths)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += loss.detach()
            if rank == 0 and step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, steps_per_epoch,
                         loss.item(), scheduler.get_last_lr()[0])

        dist.all_reduce(running)
        train_loss = running.item() / (steps_per_epoch * world)
        if rank == 0:
            cer, wer = evaluate(model.module, val_loader, charset, device)
            log.info("epoch %d done in %.0fs, train loss %.4f, val CER %.4f WER %.4f",
                     epoch, time.time() - t0, train_loss, cer, wer)
            state = {"model": model.module.state_dict(), "charset": charset, "epoch": epoch,
                     "optimizer": optimizer.state_dict(), "cer": cer, "args": vars(args)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if cer < best_cer:
                best_cer = cer
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
