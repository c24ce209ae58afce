# -*- coding: utf-8 -*-
"""
电商评论质量分级（5 档：垃圾/无效/一般/优质/精选），用于评论区排序
backbone: hfl/chinese-roberta-wwm-ext，head: [CLS] + mean pooling 拼接后接 MLP
类别不均衡，用 focal loss。

    torchrun --nproc_per_node=8 13_ecom_review_cls.py --cfg cfg/review_quality.yaml
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("review_quality")
NUM_CLASSES = 5


class ReviewDataset(Dataset):
    def __init__(self, df, tokenizer, max_len):
        # 评论内容 + 追评 拼在一起，追评没有就只用主评
        self.texts = (df["content"].fillna("") + "[SEP]" + df["append_content"].fillna("")).tolist()
        self.labels = df["level"].astype(int).tolist()
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, idx):
        enc = self.tok(self.texts[idx], truncation=True, max_length=self.max_len)
        return enc["input_ids"], self.labels[idx]


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        ids, labels = zip(*batch)
        L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), self.pad_id, dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = torch.tensor(x)
        return input_ids, (input_ids != self.pad_id).long(), torch.tensor(labels)


class ReviewClassifier(nn.Module):
    def __init__(self, pretrained, num_classes, dropout=0.2):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(pretrained)
        hidden = self.encoder.config.hidden_size
        self.head = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(hidden * 2, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, input_ids, attention_mask):
        hs = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        cls_vec = hs[:, 0]
        m = attention_mask.unsqueeze(-1).to(hs.dtype)
        mean_vec = (hs * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.head(torch.cat([cls_vec, mean_vec], dim=-1))


def focal_loss(logits, target, gamma=2.0, alpha=None):
    logp = F.log_softmax(logits, dim=-1)
    logp_t = logp.gather(1, target.unsqueeze(1)).squeeze(1)
    p_t = logp_t.exp()
    loss = -((1 - p_t) ** gamma) * logp_t
    if alpha is not None:
        loss = loss * alpha[target]
    return loss.mean()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for input_ids, attn, labels in loader:
        logits = model(input_ids.to(device), attn.to(device))
        pred = logits.argmax(-1)
        idx = labels.to(device) * NUM_CLASSES + pred
        confusion += torch.bincount(idx, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(confusion)
    model.train()
    cm = confusion.double()
    tp = cm.diag()
    precision = tp / cm.sum(0).clamp(min=1)
    recall = tp / cm.sum(1).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-8)
    return (tp.sum() / cm.sum()).item(), f1.mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    with open(ap.parse_args().cfg, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    seed_everything(cfg.get("seed", 42))

    tokenizer = AutoTokenizer.from_pretrained(cfg["pretrained"])
    train_df = pd.read_parquet(cfg["train_file"])
    dev_df = pd.read_parquet(cfg["dev_file"])
    train_ds = ReviewDataset(train_df, tokenizer, cfg.get("max_len", 256))
    dev_ds = ReviewDataset(dev_df, tokenizer, cfg.get("max_len", 256))
    collate = Collator(tokenizer.pad_token_id)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 42))
    dev_sampler = DistributedSampler(dev_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              collate_fn=collate, num_workers=6, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=128, sampler=dev_sampler, collate_fn=collate, num_workers=2)

    # 类别权重：按训练集频率的倒数开根号
    counts = np.bincount(train_df["level"].astype(int), minlength=NUM_CLASSES).astype(np.float64)
    alpha = torch.tensor((counts.sum() / np.maximum(counts, 1)) ** 0.5, dtype=torch.float, device=device)
    alpha = alpha / alpha.mean()

    model = ReviewClassifier(cfg["pretrained"], NUM_CLASSES).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    enc_params = [p for n, p in model.named_parameters() if n.startswith("module.encoder.")]
    head_params = [p for n, p in model.named_parameters() if n.startswith("module.head.")]
    optimizer = torch.optim.AdamW([
        {"params": enc_params, "lr": cfg["lr"]},
        {"params": head_params, "lr": cfg["lr"] * 10},
    ], weight_decay=0.01)
    total_steps = len(train_loader) * cfg["epochs"]
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.05 * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    logger.info("train %d / dev %d, class counts %s, alpha %s", len(train_ds), len(dev_ds),
                counts.tolist(), [round(x, 3) for x in alpha.tolist()])

    best_f1 = 0.0
    step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for input_ids, attn, labels in train_loader:
            input_ids, attn, labels = input_ids.to(device), attn.to(device), labels.to(device)
            with torch.cuda.amp.autocast():
                logits = model(input_ids, attn)
            loss = focal_loss(logits.float(), labels, gamma=cfg.get("gamma", 2.0), alpha=alpha)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e (%.1fs)", epoch, step, loss.item(),
                            scheduler.get_last_lr()[0], time.time() - t0)

        acc, macro_f1 = evaluate(model.module, dev_loader, device)
        logger.info("==> epoch %d  dev acc %.4f  macro-F1 %.4f", epoch, acc, macro_f1)
        if rank == 0 and macro_f1 > best_f1:
            best_f1 = macro_f1
            os.makedirs(cfg["output_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "cfg": cfg, "epoch": epoch, "macro_f1": macro_f1},
                       os.path.join(cfg["output_dir"], "best.pt"))
            tokenizer.save_pretrained(cfg["output_dir"])
            logger.info("best 更新: %.4f", best_f1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
