#!/usr/bin/env python
# CRNN + CTC handwritten line recognition on IAM (lines split of Aachen).
# torchrun --nproc_per_node=4 02_crnn_iam_lines.py --data /data/iam
import argparse
import logging
import os
import random
import time

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

logger = logging.getLogger("crnn")

IAM_CHARS = " !\"#&'()*+,-./0123456789:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


class CharCodec:
    def __init__(self, chars):
        self.chars = chars
        self.idx = {c: i + 1 for i, c in enumerate(chars)}  # 0 = CTC blank

    def encode(self, text):
        return [self.idx[c] for c in text if c in self.idx]

    def decode_greedy(self, ids):
        out, prev = [], 0
        for i in ids:
            if i != prev and i != 0:
                out.append(self.chars[i - 1])
            prev = i
        return "".join(out)

    def __len__(self):
        return len(self.chars) + 1


class IAMLines(Dataset):
    def __init__(self, root, split, codec, height=64, max_width=1600, augment=False):
        self.root = root
        self.codec = codec
        self.h, self.max_w = height, max_width
        self.augment = augment
        self.items = []
        with open(os.path.join(root, f"{split}.txt"), encoding="utf-8") as f:
            for line in f:
                name, text = line.rstrip("\n").split(" ", 1)
                self.items.append((name, text.replace("|", " ")))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name, text = self.items[i]
        img = Image.open(os.path.join(self.root, "lines", name + ".png")).convert("L")
        w, h = img.size
        nw = min(self.max_w, max(16, int(w * self.h / h)))
        if self.augment:
            nw = min(self.max_w, int(nw * random.uniform(0.8, 1.2)))
            img = img.rotate(random.uniform(-1.5, 1.5), fillcolor=255, expand=False)
        img = img.resize((nw, self.h), Image.BILINEAR)
        x = 1.0 - torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
        return x.unsqueeze(0), torch.tensor(self.codec.encode(text), dtype=torch.long), text


def collate(batch):
    imgs, targets, texts = zip(*batch)
    max_w = max(im.shape[-1] for im in imgs)
    max_w = (max_w + 3) // 4 * 4
    x = torch.zeros(len(imgs), 1, imgs[0].shape[1], max_w)
    widths = []
    for k, im in enumerate(imgs):
        x[k, :, :, :im.shape[-1]] = im
        widths.append(im.shape[-1])
    target_lens = torch.tensor([len(t) for t in targets], dtype=torch.long)
    return x, torch.cat(targets), target_lens, torch.tensor(widths), list(texts)


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CRNN(nn.Module):
    def __init__(self, num_classes, hidden=256):
        super().__init__()
        self.cnn = nn.Sequential(
            conv_bn(1, 64), nn.MaxPool2d(2, 2),
            conv_bn(64, 128), nn.MaxPool2d(2, 2),
            conv_bn(128, 256), conv_bn(256, 256), nn.MaxPool2d((2, 1), (2, 1)),
            conv_bn(256, 512), conv_bn(512, 512), nn.MaxPool2d((2, 1), (2, 1)),
            conv_bn(512, 512), nn.AdaptiveAvgPool2d((1, None)),
        )
        self.rnn = nn.LSTM(512, hidden, num_layers=2, bidirectional=True, batch_first=True, dropout=0.25)
        self.fc = nn.Linear(hidden * 2, num_classes)

    def forward(self, x):
        f = self.cnn(x).squeeze(2).permute(0, 2, 1)  # B, T, C
        f, _ = self.rnn(f)
        return self.fc(f)  # B, T, K


def ctc_step(model, batch, device, ctc):
    x, targets, target_lens, widths, _ = batch
    x = x.to(device, non_blocking=True)
    logits = model(x)
    log_probs = F.log_softmax(logits.float(), dim=-1).permute(1, 0, 2)  # T, B, K
    input_lens = torch.clamp(widths // 4, max=log_probs.shape[0])
    return ctc(log_probs, targets, input_lens, target_lens), logits


@torch.no_grad()
def evaluate(model, loader, codec, device):
    model.eval()
    acc = torch.zeros(4, dtype=torch.float64, device=device)  # char_err, chars, word_err, words
    for x, _, _, widths, texts in loader:
        logits = model(x.to(device, non_blocking=True))
        best = logits.argmax(-1).cpu()
        for k, gt in enumerate(texts):
            T = min(int(widths[k]) // 4, best.shape[1])
            pred = codec.decode_greedy(best[k, :T].tolist())
            acc[0] += editdistance.eval(pred, gt)
            acc[1] += len(gt)
            acc[2] += editdistance.eval(pred.split(), gt.split())
            acc[3] += len(gt.split())
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item(), (acc[2] / acc[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="checkpoints/crnn_iam")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--amp", action="store_true")
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1234)

    codec = CharCodec(IAM_CHARS)
    train_ds = IAMLines(args.data, "train", codec, args.height, augment=True)
    val_ds = IAMLines(args.data, "val", codec, args.height)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.bs, shuffle=False,
                        collate_fn=collate, num_workers=4)

    model = CRNN(len(codec)).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_cer = float("inf")
    step = 0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for batch in train_dl:
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss, _ = ctc_step(model, batch, device, ctc)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(), sched.get_last_lr()[0])

        cer, wer = evaluate(model, val_dl, codec, device)
        logger.info("epoch %d done in %.0fs  val CER %.4f  WER %.4f", epoch, time.time() - tic, cer, wer)
        if rank == 0:
            ckpt = {"model": model.module.state_dict(), "chars": codec.chars, "epoch": epoch, "cer": cer}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if cer < best_cer:
                best_cer = cer
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
                logger.info("new best CER %.4f", cer)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
