# -*- coding: utf-8 -*-
"""
短视频多标签打标（标题 + ASR 文本 -> 标签集合，约 1800 个标签）

loss 用 ASL（Asymmetric Loss）缓解正负样本极度不均衡；验证指标为阈值 0.5 下的 micro P/R/F1
启动：
    torchrun --nproc_per_node=8 15_video_tag_multilabel.py --cfg configs/video_tag_roberta.yaml
"""
import os
import json
import time
import argparse
import logging

import yaml
import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoTokenizer, AutoModel, get_cosine_schedule_with_warmup

logger = logging.getLogger("video_tag")


class Cfg(dict):
    __getattr__ = dict.__getitem__


class VideoTextDataset(Dataset):
    def __init__(self, path, tag2id, tokenizer, max_len):
        self.items = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                text = d["title"] + "[SEP]" + d.get("asr", "")[:400]
                tags = [tag2id[t] for t in d["tags"] if t in tag2id]
                self.items.append((text, tags))
        self.tok, self.max_len, self.num_tags = tokenizer, max_len, len(tag2id)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        text, tags = self.items[i]
        y = torch.zeros(self.num_tags)
        y[tags] = 1.0
        return text, y

    def collate(self, batch):
        texts, ys = zip(*batch)
        enc = self.tok(list(texts), max_length=self.max_len, truncation=True, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.stack(ys)


class TagModel(nn.Module):
    def __init__(self, pretrained, num_tags):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(pretrained)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(self.encoder.config.hidden_size, num_tags))

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).float()
        return self.head((h * m).sum(1) / m.sum(1))


class AsymmetricLoss(nn.Module):
    def __init__(self, gamma_neg=4, gamma_pos=0, clip=0.05):
        super().__init__()
        self.gamma_neg, self.gamma_pos, self.clip = gamma_neg, gamma_pos, clip

    def forward(self, logits, y):
        p = torch.sigmoid(logits)
        p_neg = (p - self.clip).clamp(min=0)
        loss_pos = y * torch.log(p.clamp(min=1e-8)) * (1 - p) ** self.gamma_pos
        loss_neg = (1 - y) * torch.log((1 - p_neg).clamp(min=1e-8)) * p_neg ** self.gamma_neg
        return -(loss_pos + loss_neg).sum(1).mean()


@torch.no_grad()
def validate(model, dataset, device, bs, thr=0.5):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    loader = DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=bs,
                        collate_fn=dataset.collate, num_workers=2)
    stat = torch.zeros(3, device=device, dtype=torch.float64)  # tp, pred, gold
    for ids, mask, y in loader:
        ids, mask, y = ids.to(device), mask.to(device), y.to(device)
        pred = (torch.sigmoid(model.module(ids, mask)) > thr).float()
        stat[0] += (pred * y).sum()
        stat[1] += pred.sum()
        stat[2] += y.sum()
    dist.all_reduce(stat)
    model.train()
    p = (stat[0] / stat[1].clamp(min=1)).item()
    r = (stat[0] / stat[2].clamp(min=1)).item()
    return p, r, 2 * p * r / max(p + r, 1e-9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = Cfg(yaml.safe_load(open(ap.parse_args().cfg, encoding="utf-8")))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    exp_dir = os.path.join(cfg.work_dir, cfg.exp_name)
    os.makedirs(exp_dir, exist_ok=True)
    writer = SummaryWriter(log_dir=os.path.join(exp_dir, "tensorboard"))

    with open(cfg.tag_file, encoding="utf-8") as f:
        tag_list = [t.strip() for t in f if t.strip()]
    tag2id = {t: i for i, t in enumerate(tag_list)}
    tokenizer = AutoTokenizer.from_pretrained(cfg.pretrained)
    train_set = VideoTextDataset(cfg.train_file, tag2id, tokenizer, cfg.max_len)
    val_set = VideoTextDataset(cfg.val_file, tag2id, tokenizer, cfg.max_len)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, collate_fn=train_set.collate,
                        num_workers=4, pin_memory=True, drop_last=True)
    logger.info("标签数 %d, 训练 %d, 验证 %d", len(tag2id), len(train_set), len(val_set))

    model = TagModel(cfg.pretrained, len(tag2id)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW([
        {"params": model.module.encoder.parameters(), "lr": cfg.lr},
        {"params": model.module.head.parameters(), "lr": cfg.head_lr},
    ], weight_decay=0.01)
    total = len(loader) * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(total * 0.06), total)
    criterion = AsymmetricLoss()
    scaler = torch.cuda.amp.GradScaler()

    step, best_f1 = 0, 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, mask, y in loader:
            ids, mask, y = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                logits = model(ids, mask)
            loss = criterion(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/grad_norm", grad_norm.item(), step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                logger.info("epoch %d step %d/%d loss %.4f gnorm %.3f %.1fs", epoch, step, total,
                            loss.item(), grad_norm.item(), time.time() - t0)
                t0 = time.time()

        p, r, f1 = validate(model, val_set, device, cfg.batch_size * 2)
        writer.add_scalar("val/precision", p, epoch)
        writer.add_scalar("val/recall", r, epoch)
        writer.add_scalar("val/micro_f1", f1, epoch)
        logger.info("epoch %d val P %.4f R %.4f micro-F1 %.4f", epoch, p, r, f1)
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(exp_dir, "last.pt"))
            if f1 > best_f1:
                best_f1 = f1
                torch.save(model.module.state_dict(), os.path.join(exp_dir, "best.pt"))
                logger.info("best micro-F1 更新为 %.4f", best_f1)
        dist.barrier()

    writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
