"""Handwritten text line recognition (IAM lines) - CNN-BiLSTM-CTC.

    torchrun --standalone --nproc_per_node=4 train_htr.py --iam-root /data/IAM --epochs 150
"""
import argparse
import os
import random
import time

import cv2
import editdistance
import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iam-root", required=True)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--max-width", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="checkpoints/htr_iam")
    return ap.parse_args()


def read_split(root, split):
    """IAM lines.txt + RWTH split files (trainset.txt / validationset1.txt / testset.txt)."""
    with open(os.path.join(root, "splits", f"{split}.txt")) as f:
        keep = {l.strip() for l in f if l.strip()}
    items = []
    with open(os.path.join(root, "ascii", "lines.txt")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.strip().split(" ")
            lid, status = parts[0], parts[1]
            if lid not in keep or status != "ok":
                continue
            text = " ".join(parts[8:]).replace("|", " ")
            a, b = lid.split("-")[:2]
            path = os.path.join(root, "lines", a, f"{a}-{b}", f"{lid}.png")
            items.append((path, text))
    return items


def build_charset(root):
    # fixed from the full lines.txt so every process gets the same mapping
    chars = set()
    with open(os.path.join(root, "ascii", "lines.txt")) as f:
        for line in f:
            if not line.startswith("#"):
                chars.update(" ".join(line.strip().split(" ")[8:]).replace("|", " "))
    return sorted(chars)


class IAMLines(Dataset):
    def __init__(self, items, charset, height, max_width, augment=False):
        self.items = items
        self.c2i = {c: i + 1 for i, c in enumerate(charset)}
        self.h, self.max_w = height, max_width
        self.augment = augment

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        img = cv2.imread(path, cv2.IMREAD_GRAYSCALE)
        h, w = img.shape
        nw = min(int(w * self.h / h), self.max_w)
        if self.augment:
            nw = min(int(nw * random.uniform(0.8, 1.2)), self.max_w)
            shear = random.uniform(-0.3, 0.3)
            M = np.float32([[1, shear, -shear * h / 2], [0, 1, 0]])
            img = cv2.warpAffine(img, M, (w, h), borderValue=255)
        img = cv2.resize(img, (max(nw, 16), self.h), interpolation=cv2.INTER_AREA)
        x = torch.from_numpy(1.0 - img.astype(np.float32) / 255.0)[None]
        y = torch.tensor([self.c2i[c] for c in text], dtype=torch.long)
        return x, y, text


def collate(batch):
    xs, ys, texts = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    imgs = torch.zeros(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        imgs[i, :, :, :x.shape[-1]] = x
    widths = torch.tensor([x.shape[-1] for x in xs])
    return imgs, widths, torch.cat(ys), torch.tensor([len(y) for y in ys]), list(texts)


class HTRNet(nn.Module):
    def __init__(self, n_classes, hidden=256):
        super().__init__()
        cfg = [(1, 32), (32, 64), "M", (64, 128), (128, 128), "M", (128, 256), (256, 256), "Mh", (256, 256)]
        layers = []
        for c in cfg:
            if c == "M":
                layers.append(nn.MaxPool2d(2))
            elif c == "Mh":
                layers.append(nn.MaxPool2d((2, 1)))
            else:
                layers += [nn.Conv2d(c[0], c[1], 3, padding=1), nn.BatchNorm2d(c[1]), nn.LeakyReLU(0.1, True)]
        self.cnn = nn.Sequential(*layers)
        self.rnn = nn.LSTM(256 * 8, hidden, num_layers=3, bidirectional=True, dropout=0.3)
        self.fc = nn.Linear(hidden * 2, n_classes)

    def forward(self, x):
        f = self.cnn(x)                      # B, 256, H/8, W/4
        b, c, h, w = f.shape
        f = f.permute(3, 0, 1, 2).reshape(w, b, c * h)
        f, _ = self.rnn(f)
        return self.fc(f)                    # T, B, C


def greedy_decode(logits, widths, charset):
    best = logits.argmax(-1).t().cpu().numpy()  # B, T
    outs = []
    for seq, w in zip(best, widths.tolist()):
        seq = seq[: w // 4]
        s, prev = [], 0
        for k in seq:
            if k != prev and k != 0:
                s.append(charset[k - 1])
            prev = k
        outs.append("".join(s))
    return outs


@torch.no_grad()
def evaluate(model, loader, charset, device):
    model.eval()
    agg = torch.zeros(4, dtype=torch.float64, device=device)  # char edits, chars, word edits, words
    for imgs, widths, _, _, texts in loader:
        logits = model(imgs.to(device))
        for pred, gt in zip(greedy_decode(logits, widths, charset), texts):
            agg[0] += editdistance.eval(pred, gt)
            agg[1] += len(gt)
            agg[2] += editdistance.eval(pred.split(), gt.split())
            agg[3] += len(gt.split())
    dist.all_reduce(agg)
    model.train()
    return (agg[0] / agg[1]).item(), (agg[2] / agg[3]).item()


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    charset = build_charset(args.iam_root)
    train_ds = IAMLines(read_split(args.iam_root, "trainset"), charset, args.height, args.max_width, augment=True)
    val_ds = IAMLines(read_split(args.iam_root, "validationset1"), charset, args.height, args.max_width)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=args.workers)

    model = HTRNet(len(charset) + 1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(0.5 * args.epochs), int(0.75 * args.epochs)], 0.1)
    ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train lines, {len(val_ds)} val lines, {len(charset)} symbols")
    best_cer = float("inf")
    for epoch in range(args.epochs):
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for imgs, widths, targets, tgt_lens, _ in train_dl:
            imgs = imgs.to(device, non_blocking=True)
            logits = model(imgs)
            log_probs = logits.float().log_softmax(2)
            in_lens = torch.clamp(widths // 4, max=log_probs.size(0))
            loss = ctc(log_probs, targets, in_lens, tgt_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(running)

        cer, wer = evaluate(model, val_dl, charset, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {(running[0] / running[1]).item():.4f} CER {cer * 100:.2f} WER {wer * 100:.2f} "
                  f"char-acc {(1 - cer) * 100:.2f} ({time.time() - t0:.0f}s)", flush=True)
            if cer < best_cer:
                best_cer = cer
                torch.save({"model": model.module.state_dict(), "charset": charset, "epoch": epoch,
                            "cer": cer}, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
