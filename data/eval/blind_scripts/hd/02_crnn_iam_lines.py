"""CRNN + CTC handwritten line recognition on IAM.

Expects the IAM "lines" folder and the ascii/lines.txt transcription file.
Launch:
    torchrun --standalone --nproc_per_node=4 02_crnn_iam_lines.py --iam-root /datasets/IAM
"""
import argparse
import logging
import os
import random

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms as T

log = logging.getLogger("crnn")

CHARSET = " !\"#&'()*+,-./0123456789:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iam-root", required=True)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--max-width", type=int, default=1600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--ckpt-dir", default="checkpoints/crnn_iam")
    return ap.parse_args()


def read_iam_lines(root):
    samples = []
    with open(os.path.join(root, "ascii", "lines.txt")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.strip().split(" ")
            if parts[1] != "ok":
                continue
            lid = parts[0]
            a, b = lid.split("-")[:2]
            text = " ".join(parts[8:]).replace("|", " ")
            path = os.path.join(root, "lines", a, f"{a}-{b}", lid + ".png")
            samples.append((path, text))
    return samples


class LineDataset(Dataset):
    def __init__(self, samples, height, max_width, augment=False):
        self.samples = samples
        self.height, self.max_width = height, max_width
        self.char2idx = {c: i + 1 for i, c in enumerate(CHARSET)}  # 0 = blank
        self.aug = T.Compose([
            T.RandomAffine(degrees=2, shear=5, scale=(0.9, 1.05), fill=255),
            T.ColorJitter(0.3, 0.3),
        ]) if augment else None

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, text = self.samples[i]
        img = Image.open(path).convert("L")
        if self.aug is not None:
            img = self.aug(img)
        w = min(self.max_width, max(32, int(img.width * self.height / img.height)))
        img = img.resize((w, self.height), Image.BILINEAR)
        x = 1.0 - torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
        y = torch.tensor([self.char2idx[c] for c in text if c in self.char2idx], dtype=torch.long)
        return x.unsqueeze(0), y, text


def collate(batch):
    imgs, labels, texts = zip(*batch)
    maxw = max(im.shape[-1] for im in imgs)
    out = torch.zeros(len(imgs), 1, imgs[0].shape[1], maxw)
    for i, im in enumerate(imgs):
        out[i, :, :, : im.shape[-1]] = im
    lengths = torch.tensor([len(l) for l in labels], dtype=torch.long)
    return out, torch.cat(labels), lengths, list(texts)


def conv_bn(cin, cout, pool=None):
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1, inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(pool))
    return nn.Sequential(*layers)


class CRNN(nn.Module):
    def __init__(self, n_classes, height=64, hidden=256):
        super().__init__()
        self.cnn = nn.Sequential(
            conv_bn(1, 64, (2, 2)), conv_bn(64, 128, (2, 2)), conv_bn(128, 256),
            conv_bn(256, 256, (2, 1)), conv_bn(256, 512), conv_bn(512, 512, (2, 1)),
            nn.Dropout2d(0.2),
        )
        feat_h = height // 16
        self.proj = nn.Linear(512 * feat_h, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=3, bidirectional=True, dropout=0.3, batch_first=True)
        self.fc = nn.Linear(2 * hidden, n_classes)

    def forward(self, x):
        f = self.cnn(x)  # B, C, H', W'
        b, c, h, w = f.shape
        f = f.permute(0, 3, 1, 2).reshape(b, w, c * h)
        f, _ = self.rnn(self.proj(f))
        return self.fc(f)  # B, T, C


def greedy_decode(logits):
    out = []
    for seq in logits.argmax(-1).cpu().tolist():
        prev, s = 0, []
        for k in seq:
            if k != prev and k != 0:
                s.append(CHARSET[k - 1])
            prev = k
        out.append("".join(s))
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    errs = torch.zeros(2, dtype=torch.float64, device=device)
    for x, _, _, texts in loader:
        preds = greedy_decode(model(x.to(device)))
        for p, t in zip(preds, texts):
            errs[0] += editdistance.eval(p, t)
            errs[1] += len(t)
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    # different augmentation stream on each rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    samples = read_iam_lines(args.iam_root)
    random.shuffle(samples)
    n_val = int(len(samples) * args.val_frac)
    val_samples, train_samples = samples[:n_val], samples[n_val:]
    log.info("train lines: %d  val lines: %d", len(train_samples), len(val_samples))

    train_ds = LineDataset(train_samples, args.height, args.max_width, augment=True)
    val_ds = LineDataset(val_samples[rank::world_size], args.height, args.max_width)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=32, collate_fn=collate, num_workers=4)

    model = CRNN(len(CHARSET) + 1, args.height).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=8)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    best_cer = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        total, steps = 0.0, 0
        for x, y, ylen, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device)
            logits = model(x)
            log_probs = F.log_softmax(logits, dim=-1).permute(1, 0, 2)  # T, B, C
            in_len = torch.full((x.size(0),), log_probs.size(0), dtype=torch.long)
            loss = ctc(log_probs, y, in_len, ylen)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            total += loss.item()
            steps += 1

        cer = evaluate(model.module, val_loader, device)
        scheduler.step(cer)
        log.info("epoch %d  train ctc %.4f  val CER %.4f", epoch, total / max(steps, 1), cer)
        if rank == 0 and cer < best_cer:
            best_cer = cer
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "cer": cer, "charset": CHARSET},
                       os.path.join(args.ckpt_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
