# -*- coding: utf-8 -*-
"""
OCR 文字识别（CRNN + CTC）分布式训练

数据：票据 / 截图文本行小图，标注格式 `img_path\tlabel`
启动：
    python -m torch.distributed.launch --nproc_per_node=8 02_ocr_crnn_ctc.py \
        --data_root /mnt/nas/ocr/rec_data --output_dir /mnt/nas/ocr/exp/crnn_v3
"""
import os
import sys
import time
import argparse
import logging

import cv2
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("ocr_rec")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", type=str, required=True)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--img_h", type=int, default=32)
    parser.add_argument("--img_w", type=int, default=320)
    parser.add_argument("--batch_size", type=int, default=128, help="单卡 batch size")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--resume", type=str, default=None)
    # 兼容老版本 launch（--local_rank）和新版本（--local-rank）
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    return parser.parse_args()


def setup_logger(rank, output_dir):
    fmt = logging.Formatter("[%(asctime)s][rank{}] %(message)s".format(rank))
    sh = logging.StreamHandler(sys.stdout)
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if rank == 0:
        fh = logging.FileHandler(os.path.join(output_dir, "train.log"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)
        logger.setLevel(logging.INFO)
    else:
        logger.setLevel(logging.ERROR)


def build_char_dict(label_file, dict_path):
    """扫描训练标注生成字符表，0 号留给 CTC blank"""
    chars = set()
    with open(label_file, "r", encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 2:
                chars.update(parts[1])
    chars = sorted(chars)
    with open(dict_path, "w", encoding="utf-8") as f:
        for c in chars:
            f.write(c + "\n")


def load_char_dict(dict_path):
    with open(dict_path, "r", encoding="utf-8") as f:
        chars = [line.rstrip("\n") for line in f]
    return {c: i + 1 for i, c in enumerate(chars)}


class RecDataset(Dataset):
    def __init__(self, root, label_file, char2idx, img_h, img_w):
        self.root = root
        self.char2idx = char2idx
        self.img_h, self.img_w = img_h, img_w
        self.items = []
        with open(label_file, "r", encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 2 and parts[1]:
                    self.items.append(parts)

    def __len__(self):
        return len(self.items)

    def resize_norm(self, img):
        h, w = img.shape[:2]
        new_w = min(self.img_w, int(np.ceil(self.img_h * w / float(h))))
        img = cv2.resize(img, (new_w, self.img_h)).astype(np.float32) / 255.0
        img = (img - 0.5) / 0.5
        out = np.zeros((self.img_h, self.img_w, 3), dtype=np.float32)
        out[:, :new_w] = img
        return out.transpose(2, 0, 1)

    def __getitem__(self, idx):
        path, text = self.items[idx]
        img = cv2.imread(os.path.join(self.root, path))
        if img is None:
            img = np.zeros((self.img_h, self.img_w, 3), dtype=np.uint8)
        target = [self.char2idx[c] for c in text if c in self.char2idx]
        return torch.from_numpy(self.resize_norm(img)), torch.tensor(target, dtype=torch.long), text


def collate_fn(batch):
    imgs, targets, texts = zip(*batch)
    lengths = torch.tensor([len(t) for t in targets], dtype=torch.long)
    return torch.stack(imgs), torch.cat(targets), lengths, list(texts)


class CRNN(nn.Module):
    def __init__(self, num_classes, hidden=256):
        super().__init__()

        def conv_bn(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.cnn = nn.Sequential(
            conv_bn(3, 64), nn.MaxPool2d(2, 2),
            conv_bn(64, 128), nn.MaxPool2d(2, 2),
            conv_bn(128, 256), conv_bn(256, 256), nn.MaxPool2d((2, 1), (2, 1)),
            conv_bn(256, 512), conv_bn(512, 512), nn.MaxPool2d((2, 1), (2, 1)),
            conv_bn(512, 512),
        )
        self.rnn = nn.LSTM(512, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(hidden * 2, num_classes)

    def forward(self, x):
        feat = self.cnn(x)                # B, C, H', W'
        feat = F.adaptive_avg_pool2d(feat, (1, None)).squeeze(2).permute(0, 2, 1)  # B, T, C
        seq, _ = self.rnn(feat)
        return self.fc(seq)               # B, T, num_classes


def ctc_greedy_decode(logits, idx2char):
    preds = logits.argmax(-1).cpu().numpy()
    results = []
    for p in preds:
        chars, prev = [], 0
        for t in p:
            if t != prev and t != 0:
                chars.append(idx2char[t])
            prev = t
        results.append("".join(chars))
    return results


@torch.no_grad()
def evaluate(model, dataset, idx2char, rank, world_size, device, batch_size):
    model.eval()
    shard = Subset(dataset, list(range(rank, len(dataset), world_size)))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=4, collate_fn=collate_fn)
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for imgs, _, _, texts in loader:
        logits = model.module(imgs.to(device, non_blocking=True))
        preds = ctc_greedy_decode(logits, idx2char)
        correct += sum(int(p == t) for p, t in zip(preds, texts))
        total += len(texts)
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return (correct / total.clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    dist.barrier()
    setup_logger(rank, args.output_dir)

    # 字符表只由 rank0 生成，其余进程等待生成完毕后再读取
    dict_path = os.path.join(args.output_dir, "char_dict.txt")
    train_label = os.path.join(args.data_root, "train_list.txt")
    if rank == 0 and not os.path.exists(dict_path):
        build_char_dict(train_label, dict_path)
    dist.barrier()
    char2idx = load_char_dict(dict_path)
    idx2char = {v: k for k, v in char2idx.items()}
    num_classes = len(char2idx) + 1
    logger.info("字符表大小: %d", num_classes)

    train_set = RecDataset(args.data_root, train_label, char2idx, args.img_h, args.img_w)
    val_set = RecDataset(args.data_root, os.path.join(args.data_root, "val_list.txt"), char2idx, args.img_h, args.img_w)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              collate_fn=collate_fn, persistent_workers=True)

    model = CRNN(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    ctc_loss = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt.get("best_acc", 0.0)
        logger.info("resume from %s, epoch %d", args.resume, start_epoch)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (imgs, targets, lengths, _) in enumerate(train_loader):
            imgs = imgs.to(device, non_blocking=True)
            logits = model(imgs)
            log_probs = logits.log_softmax(2).permute(1, 0, 2)  # T, B, C
            input_lengths = torch.full((imgs.size(0),), log_probs.size(0), dtype=torch.long)
            loss = ctc_loss(log_probs.float(), targets, input_lengths, lengths)

            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()

            if it % 100 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f lr %.6f %.2fs/100it",
                            epoch, it, len(train_loader), loss.item(), scheduler.get_last_lr()[0], time.time() - tic)
                tic = time.time()

        acc = evaluate(model, val_set, idx2char, rank, world_size, device, args.batch_size)
        logger.info("epoch %d 行准确率 %.4f (best %.4f)", epoch, acc, best_acc)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": max(acc, best_acc)}
            torch.save(state, os.path.join(args.output_dir, "latest.pth"))
            if acc > best_acc:
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pth"))
        best_acc = max(acc, best_acc)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
