# -*- coding: utf-8 -*-
"""
CRNN + CTC 中文文本行识别训练
torchrun --nproc_per_node=4 train_crnn.py --config configs/crnn_chinese.yaml
"""
import os
import sys
import time
import logging
import argparse

import cv2
import yaml
import numpy as np
from easydict import EasyDict as edict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP


def get_logger(output_dir, name="crnn"):
    """只有主进程写日志文件"""
    rank = dist.get_rank()
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    fmt = logging.Formatter("%(asctime)s %(levelname)s: %(message)s")
    sh = logging.StreamHandler(sys.stdout)
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(output_dir, "log.txt"), encoding="utf-8")
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger


class LabelConverter:
    """字符 <-> 索引, 0 留给 CTC blank"""

    def __init__(self, charset_file):
        with open(charset_file, encoding="utf-8") as f:
            chars = [c.rstrip("\n") for c in f if c.rstrip("\n")]
        self.chars = chars
        self.dict = {c: i + 1 for i, c in enumerate(chars)}

    @property
    def num_classes(self):
        return len(self.chars) + 1

    def encode(self, texts):
        lengths = [len(t) for t in texts]
        flat = [self.dict.get(c, 0) for t in texts for c in t]
        return torch.IntTensor(flat), torch.IntTensor(lengths)

    def decode(self, preds):
        # preds: [T, B] 贪心解码
        results = []
        for seq in preds.t().tolist():
            out, prev = [], 0
            for p in seq:
                if p != 0 and p != prev:
                    out.append(self.chars[p - 1])
                prev = p
            results.append("".join(out))
        return results


class TextLineDataset(Dataset):
    def __init__(self, root, label_file, img_h=32, img_w=280):
        self.root, self.img_h, self.img_w = root, img_h, img_w
        self.samples = []
        with open(label_file, encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 2:
                    self.samples.append(parts)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, text = self.samples[idx]
        img = cv2.imread(os.path.join(self.root, path), cv2.IMREAD_GRAYSCALE)
        h, w = img.shape
        new_w = min(self.img_w, int(w * self.img_h / h))
        img = cv2.resize(img, (new_w, self.img_h))
        canvas = np.zeros((self.img_h, self.img_w), dtype=np.uint8)
        canvas[:, :new_w] = img
        img = (canvas.astype(np.float32) / 255.0 - 0.5) / 0.5
        return torch.from_numpy(img).unsqueeze(0), text


def collate(batch):
    imgs, texts = zip(*batch)
    return torch.stack(imgs), list(texts)


class CRNN(nn.Module):
    def __init__(self, num_classes, nh=256):
        super().__init__()
        cfg = [(1, 64), (64, 128), (128, 256), (256, 256), (256, 512), (512, 512), (512, 512)]
        pools = {0: (2, 2), 1: (2, 2), 3: (2, 1), 5: (2, 1)}
        layers = []
        for i, (cin, cout) in enumerate(cfg):
            k, p = (2, 0) if i == 6 else (3, 1)
            layers += [nn.Conv2d(cin, cout, k, 1, p), nn.BatchNorm2d(cout), nn.ReLU(True)]
            if i in pools:
                layers.append(nn.MaxPool2d(pools[i], pools[i]))
        self.cnn = nn.Sequential(*layers)
        self.rnn = nn.LSTM(512, nh, num_layers=2, bidirectional=True)
        self.fc = nn.Linear(nh * 2, num_classes)

    def forward(self, x):
        conv = self.cnn(x)              # [B, 512, 1, W]
        conv = conv.squeeze(2).permute(2, 0, 1)  # [T, B, C]
        out, _ = self.rnn(conv)
        return self.fc(out)             # [T, B, num_classes]


@torch.no_grad()
def validate(model, loader, converter, device):
    model.eval()
    stats = torch.zeros(2, device=device)  # [正确数, 总数]
    for imgs, texts in loader:
        preds = model(imgs.to(device)).argmax(2)
        for pred, gt in zip(converter.decode(preds.cpu()), texts):
            stats[0] += float(pred == gt)
            stats[1] += 1
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/crnn_chinese.yaml")
    args = parser.parse_args()
    with open(args.config, encoding="utf-8") as f:
        cfg = edict(yaml.safe_load(f))

    logger = get_logger(cfg.OUTPUT_DIR)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    device = torch.device("cuda", local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logger.info("配置: %s", cfg)

    converter = LabelConverter(cfg.CHARSET)
    train_set = TextLineDataset(cfg.DATA.ROOT, cfg.DATA.TRAIN_LIST, cfg.IMG_H, cfg.IMG_W)
    val_set = TextLineDataset(cfg.DATA.ROOT, cfg.DATA.VAL_LIST, cfg.IMG_H, cfg.IMG_W)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg.BATCH_SIZE, sampler=train_sampler,
                              num_workers=cfg.WORKERS, collate_fn=collate, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=cfg.BATCH_SIZE,
                            sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.WORKERS, collate_fn=collate)

    model = CRNN(converter.num_classes).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
    # cfg.LR 为总 batch 256 时的学习率
    lr = cfg.LR * cfg.BATCH_SIZE * world_size / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.EPOCHS)

    best_acc = 0.0
    for epoch in range(cfg.EPOCHS):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (imgs, texts) in enumerate(train_loader):
            imgs = imgs.to(device, non_blocking=True)
            targets, target_lens = converter.encode(texts)
            logits = model(imgs)
            log_probs = F.log_softmax(logits, dim=2)
            input_lens = torch.full((imgs.size(0),), log_probs.size(0), dtype=torch.int32)
            loss = ctc(log_probs, targets, input_lens, target_lens)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            if it % cfg.PRINT_FREQ == 0:
                logger.info("epoch %d [%d/%d] ctc_loss %.4f lr %.2e %.2fs", epoch, it, len(train_loader),
                            loss.item(), optimizer.param_groups[0]["lr"], time.time() - t0)
                t0 = time.time()
        scheduler.step()

        acc = validate(model, val_loader, converter, device)
        logger.info("epoch %d 行准确率: %.4f", epoch, acc)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                       os.path.join(cfg.OUTPUT_DIR, "crnn_last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(cfg.OUTPUT_DIR, "crnn_best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
