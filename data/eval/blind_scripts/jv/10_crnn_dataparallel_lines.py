# -*- coding: utf-8 -*-
"""
CRNN line recognizer trained on all local GPUs with nn.DataParallel.

The CTC loss is computed inside the wrapped module so that the (large) per-frame
log-probabilities never have to be gathered on GPU 0.

Usage:
    CUDA_VISIBLE_DEVICES=0,1,2,3 python 10_crnn_dataparallel_lines.py --train_list lists/train.txt \
        --val_list lists/val.txt --alphabet lists/alphabet.txt --save_dir expr/crnn_dp
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
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--train_list", required=True, help="lines: <image path> <transcription>")
parser.add_argument("--val_list", required=True)
parser.add_argument("--alphabet", required=True)
parser.add_argument("--imgH", type=int, default=48)
parser.add_argument("--maxW", type=int, default=1200)
parser.add_argument("--nh", type=int, default=256)
parser.add_argument("--batchSize", type=int, default=96, help="total over all GPUs")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--nepoch", type=int, default=60)
parser.add_argument("--workers", type=int, default=12)
parser.add_argument("--save_dir", default="expr/crnn_dp")
parser.add_argument("--manualSeed", type=int, default=1111)
opt = parser.parse_args()


def read_list(path):
    samples = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            p, text = line.split(" ", 1)
            samples.append((p, text))
    return samples


class LineDataset(Dataset):
    def __init__(self, samples, alphabet, imgH, maxW, augment=False):
        self.samples = samples
        self.dict = {c: i + 1 for i, c in enumerate(alphabet)}
        self.imgH, self.maxW, self.augment = imgH, maxW, augment

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, text = self.samples[idx]
        img = cv2.imread(path, cv2.IMREAD_GRAYSCALE)
        h, w = img.shape
        ratio = w / float(h)
        if self.augment:
            ratio *= random.uniform(0.8, 1.2)
        newW = int(min(self.maxW, max(self.imgH, self.imgH * ratio)))
        img = cv2.resize(img, (newW, self.imgH), interpolation=cv2.INTER_AREA)
        img = (255 - img).astype(np.float32) / 255.0
        label = [self.dict[c] for c in text if c in self.dict]
        return torch.from_numpy(img)[None], label, text


def align_collate(batch):
    imgs, labels, texts = zip(*batch)
    maxW = max(im.shape[-1] for im in imgs)
    maxW = (maxW + 3) // 4 * 4
    out = torch.zeros(len(imgs), 1, imgs[0].shape[1], maxW)
    widths = torch.zeros(len(imgs), dtype=torch.long)
    for i, im in enumerate(imgs):
        out[i, :, :, : im.shape[-1]] = im
        widths[i] = im.shape[-1]
    maxL = max(max(len(l) for l in labels), 1)
    targets = torch.zeros(len(labels), maxL, dtype=torch.long)
    lengths = torch.zeros(len(labels), dtype=torch.long)
    for i, l in enumerate(labels):
        targets[i, : len(l)] = torch.tensor(l, dtype=torch.long)
        lengths[i] = len(l)
    return out, widths, targets, lengths, list(texts)


class BidirectionalLSTM(nn.Module):
    def __init__(self, nIn, nHidden, nOut):
        super().__init__()
        self.rnn = nn.LSTM(nIn, nHidden, bidirectional=True)
        self.embedding = nn.Linear(nHidden * 2, nOut)

    def forward(self, x):
        self.rnn.flatten_parameters()
        recurrent, _ = self.rnn(x)
        return self.embedding(recurrent)


class CRNN(nn.Module):
    def __init__(self, imgH, nclass, nh):
        super().__init__()
        ks = [3, 3, 3, 3, 3, 3, 2]
        ps = [1, 1, 1, 1, 1, 1, 0]
        nm = [64, 128, 256, 256, 512, 512, 512]
        cnn = nn.Sequential()

        def convRelu(i, bn=False):
            nIn = 1 if i == 0 else nm[i - 1]
            cnn.add_module(f"conv{i}", nn.Conv2d(nIn, nm[i], ks[i], 1, ps[i]))
            if bn:
                cnn.add_module(f"bn{i}", nn.BatchNorm2d(nm[i]))
            cnn.add_module(f"relu{i}", nn.ReLU(True))

        convRelu(0)
        cnn.add_module("pool0", nn.MaxPool2d(2, 2))
        convRelu(1)
        cnn.add_module("pool1", nn.MaxPool2d(2, 2))
        convRelu(2, True)
        convRelu(3)
        cnn.add_module("pool2", nn.MaxPool2d((2, 1), (2, 1)))
        convRelu(4, True)
        convRelu(5)
        cnn.add_module("pool3", nn.MaxPool2d((2, 1), (2, 1)))
        convRelu(6, True)
        self.cnn = cnn
        self.collapse = nn.AdaptiveAvgPool2d((1, None))
        self.rnn = nn.Sequential(BidirectionalLSTM(512, nh, nh), BidirectionalLSTM(nh, nh, nclass))

    def forward(self, x):
        conv = self.collapse(self.cnn(x)).squeeze(2)   # b, c, w
        conv = conv.permute(2, 0, 1)                   # w, b, c
        return self.rnn(conv)                          # T, b, nclass


class CTCTrainWrapper(nn.Module):
    def __init__(self, crnn):
        super().__init__()
        self.crnn = crnn
        self.ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)

    def forward(self, images, widths, targets, target_lengths):
        preds = self.crnn(images)
        log_probs = F.log_softmax(preds, dim=2)
        T = log_probs.size(0)
        input_lengths = torch.clamp((widths // 4) - 1, min=1, max=T)
        return self.ctc(log_probs, targets, input_lengths, target_lengths)


def decode(preds, widths, alphabet):
    idx = preds.argmax(2).transpose(0, 1).cpu().numpy()
    out = []
    for b in range(idx.shape[0]):
        n = max(1, int(widths[b]) // 4 - 1)
        chars, prev = [], 0
        for k in idx[b, :n]:
            if k != 0 and k != prev:
                chars.append(alphabet[k - 1])
            prev = k
        out.append("".join(chars))
    return out


def validate(crnn, loader, alphabet, device):
    crnn.eval()
    n_err = n_chars = n_correct = n_lines = 0
    with torch.no_grad():
        for images, widths, _, _, texts in loader:
            preds = crnn(images.to(device))
            for p, t in zip(decode(preds, widths, alphabet), texts):
                n_err += editdistance.eval(p, t)
                n_chars += len(t)
                n_correct += int(p == t)
                n_lines += 1
    crnn.train()
    return n_err / max(n_chars, 1), n_correct / max(n_lines, 1)


def main():
    random.seed(opt.manualSeed)
    np.random.seed(opt.manualSeed)
    torch.manual_seed(opt.manualSeed)
    os.makedirs(opt.save_dir, exist_ok=True)

    with open(opt.alphabet, encoding="utf-8") as f:
        alphabet = f.read().rstrip("\n")
    train_ds = LineDataset(read_list(opt.train_list), alphabet, opt.imgH, opt.maxW, augment=True)
    val_ds = LineDataset(read_list(opt.val_list), alphabet, opt.imgH, opt.maxW)
    train_loader = DataLoader(train_ds, batch_size=opt.batchSize, shuffle=True, num_workers=opt.workers,
                              collate_fn=align_collate, drop_last=True, pin_memory=True,
                              worker_init_fn=lambda wid: np.random.seed(opt.manualSeed + wid))
    val_loader = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=4, collate_fn=align_collate)

    device = torch.device("cuda:0")
    crnn = CRNN(opt.imgH, len(alphabet) + 1, opt.nh).to(device)
    model = CTCTrainWrapper(crnn)
    if torch.cuda.device_count() > 1:
        print(f"using {torch.cuda.device_count()} GPUs")
        model = nn.DataParallel(model)
    model.to(device)

    optimizer = torch.optim.Adam(crnn.parameters(), lr=opt.lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 45], gamma=0.1)

    best_cer = 1.0
    for epoch in range(opt.nepoch):
        t0 = time.time()
        avg, n = 0.0, 0
        for i, (images, widths, targets, lengths, _) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            loss = model(images, widths.to(device), targets.to(device), lengths.to(device))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(crnn.parameters(), 5)
            optimizer.step()
            avg += loss.item()
            n += 1
            if i % 100 == 0:
                print(f"[{epoch}/{opt.nepoch}][{i}/{len(train_loader)}] loss: {avg / n:.4f}")
        scheduler.step()

        cer, line_acc = validate(crnn, val_loader, alphabet, device)
        print(f"epoch {epoch} done in {time.time() - t0:.0f}s  train loss {avg / max(n, 1):.4f}  "
              f"val CER {cer:.4f}  line acc {line_acc:.4f}")
        torch.save({"crnn": crnn.state_dict(), "alphabet": alphabet, "epoch": epoch},
                   os.path.join(opt.save_dir, "crnn_last.pth"))
        if cer < best_cer:
            best_cer = cer
            torch.save({"crnn": crnn.state_dict(), "alphabet": alphabet, "epoch": epoch},
                       os.path.join(opt.save_dir, "crnn_best.pth"))


if __name__ == "__main__":
    main()
