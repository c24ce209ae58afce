"""
License-plate / container-code recognition: small CRNN with CTC, trained with DDP on crops from
our detector.  Annotation csv: path,text   (text upper-case, may contain '-' and spaces)

    torchrun --nproc_per_node=4 12_plate_crnn_ctc.py --cfg configs/plates.yaml
"""
import argparse
import csv
import logging
import math
import os
import random

import albumentations as A
import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

VOCAB = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ- "

DEFAULT_CFG = dict(
    train_csv="data/plates/train.csv",
    val_csv="data/plates/val.csv",
    img_root="data/plates/crops",
    img_h=32, img_w=160,
    batch_size=128, epochs=60, lr=1e-3, weight_decay=1e-4,
    num_workers=8, log_every=50,
    work_dir="work_dirs/plate_crnn",
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f))
    return argparse.Namespace(**cfg)


class PlateSet(Dataset):
    def __init__(self, csv_path, root, h, w, train):
        with open(csv_path, newline="", encoding="utf-8") as f:
            self.rows = [(r["path"], r["text"].upper()) for r in csv.DictReader(f)]
        self.root, self.h, self.w = root, h, w
        self.c2i = {c: i + 1 for i, c in enumerate(VOCAB)}
        self.aug = A.Compose([
            A.Perspective(scale=(0.02, 0.06), p=0.5),
            A.MotionBlur(blur_limit=5, p=0.2),
            A.RandomBrightnessContrast(p=0.5),
            A.ImageCompression(quality_lower=40, p=0.3),
        ]) if train else None

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        img = cv2.imread(os.path.join(self.root, path))
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        if self.aug is not None:
            img = self.aug(image=img)["image"]
        img = cv2.resize(img, (self.w, self.h), interpolation=cv2.INTER_LINEAR)
        x = torch.from_numpy(img).permute(2, 0, 1).float().div_(255).sub_(0.5).div_(0.5)
        y = torch.tensor([self.c2i[c] for c in text if c in self.c2i], dtype=torch.long)
        return x, y, text


def collate(batch):
    xs, ys, ts = zip(*batch)
    return torch.stack(xs), torch.cat(ys), torch.tensor([len(y) for y in ys], dtype=torch.long), list(ts)


class SmallCRNN(nn.Module):
    def __init__(self, n_cls):
        super().__init__()

        def cbr(i, o):
            return [nn.Conv2d(i, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(
            *cbr(3, 32), nn.MaxPool2d(2),            # 16 x 80
            *cbr(32, 64), nn.MaxPool2d(2),           # 8 x 40
            *cbr(64, 128), *cbr(128, 128), nn.MaxPool2d((2, 1)),  # 4 x 40
            *cbr(128, 256), *cbr(256, 256), nn.MaxPool2d((4, 1)),  # 1 x 40
        )
        self.seq = nn.GRU(256, 128, num_layers=2, bidirectional=True, batch_first=True)
        self.cls = nn.Linear(256, n_cls)

    def forward(self, x):
        f = self.features(x).squeeze(2).transpose(1, 2)  # B, 40, 256
        f, _ = self.seq(f)
        return self.cls(f)


def decode(logits):
    out = []
    for row in logits.argmax(-1).cpu().numpy():
        s, prev = [], 0
        for k in row:
            if k != prev and k != 0:
                s.append(VOCAB[k - 1])
            prev = k
        out.append("".join(s))
    return out


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    hit = torch.zeros(2, device=device)
    for x, _, _, texts in loader:
        preds = decode(net(x.to(device)))
        hit[0] += sum(int(p == t) for p, t in zip(preds, texts))
        hit[1] += len(texts)
    dist.all_reduce(hit)
    net.train()
    return (hit[0] / hit[1].clamp(min=1)).item()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100)

    train_set = PlateSet(cfg.train_csv, cfg.img_root, cfg.img_h, cfg.img_w, train=True)
    val_set = PlateSet(cfg.val_csv, cfg.img_root, cfg.img_h, cfg.img_w, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            256, num_workers=4, collate_fn=collate)

    model = DDP(SmallCRNN(len(VOCAB) + 1).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * len(train_loader)
    warm = min(1000, steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    criterion = nn.CTCLoss(blank=0, reduction="mean")

    writer = SummaryWriter(os.path.join(cfg.work_dir, "tb")) if rank == 0 else None
    best, step = 0.0, 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y, ylen, _ in train_loader:
            x = x.to(device, non_blocking=True)
            logits = model(x)
            log_probs = logits.log_softmax(-1).transpose(0, 1)
            in_len = torch.full((x.size(0),), log_probs.size(0), dtype=torch.long)
            loss = criterion(log_probs, y, in_len, ylen)
            if not torch.isfinite(loss):
                # occasional mislabeled crops give an infeasible alignment
                logging.warning("rank %d: non-finite CTC loss at step %d, skipping batch", rank, step)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if writer is not None and step % cfg.log_every == 0:
                writer.add_scalar("loss/ctc", loss.item(), step)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], step)

        acc = validate(model.module, val_loader, device)
        logging.info("epoch %d  val plate accuracy %.4f", epoch, acc)
        if rank == 0:
            writer.add_scalar("val/acc", acc, epoch)
            ck = {"model": model.module.state_dict(), "epoch": epoch, "acc": acc, "vocab": VOCAB}
            torch.save(ck, os.path.join(cfg.work_dir, "last.pth"))
            if acc > best:
                best = acc
                torch.save(ck, os.path.join(cfg.work_dir, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
