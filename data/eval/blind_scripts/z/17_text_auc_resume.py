# -*- coding: utf-8 -*-
"""
违规评论识别（二分类）多卡训练，验证集指标为 AUC，支持断点续训。
集群任务经常被抢占，所以每个 epoch 都存一次完整状态（模型 + 优化器 + 调度器 + scaler）。

启动 / 续训：
    torchrun --nproc_per_node=8 17_text_auc_resume.py --train data/train.csv --valid data/valid.csv
    torchrun --nproc_per_node=8 17_text_auc_resume.py --train data/train.csv --valid data/valid.csv \
        --resume output/risk_cls/last.pt
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("risk")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--pretrained", default="hfl/chinese-roberta-wwm-ext")
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--output", default="output/risk_cls")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class CommentDataset(Dataset):
    def __init__(self, csv_path):
        df = pd.read_csv(csv_path)
        self.texts = df["content"].astype(str).tolist()
        self.labels = df["is_risk"].astype(int).tolist()

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return i, self.texts[i], self.labels[i]


class Collate:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        idx, texts, labels = zip(*batch)
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        return torch.tensor(idx), enc, torch.tensor(labels, dtype=torch.float)


class RiskClassifier(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        hidden = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, 1)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids).last_hidden_state
        # mean pooling
        m = attention_mask.unsqueeze(-1).float()
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-6)
        return self.head(self.dropout(pooled)).squeeze(-1)


@torch.no_grad()
def validate(model, loader, device, world_size):
    model.eval()
    idx_l, prob_l, y_l = [], [], []
    for idx, enc, y in loader:
        enc = {k: v.to(device) for k, v in enc.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            logit = model(**enc)
        idx_l.append(idx.to(device))
        prob_l.append(torch.sigmoid(logit.float()))
        y_l.append(y.to(device))
    local = torch.stack([torch.cat(idx_l).float(), torch.cat(prob_l), torch.cat(y_l)])
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    allv = torch.cat(gathered, dim=1).cpu().numpy()
    # DistributedSampler 会补齐样本，按下标去重
    _, keep = np.unique(allv[0].astype(np.int64), return_index=True)
    return roc_auc_score(allv[2, keep], allv[1, keep]), len(keep)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    tok = AutoTokenizer.from_pretrained(args.pretrained)
    collate = Collate(tok, args.max_len)
    train_set, valid_set = CommentDataset(args.train), CommentDataset(args.valid)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    valid_sampler = DistributedSampler(valid_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=args.batch_size * 2, sampler=valid_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)

    model = RiskClassifier(args.pretrained).to(device)
    pos_ratio = np.mean(train_set.labels)
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos_ratio) / pos_ratio, device=device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_auc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_auc = ckpt["epoch"] + 1, ckpt["best_auc"]
        logger.info("从 %s 恢复，下一个 epoch=%d，历史最优 AUC=%.4f", args.resume, start_epoch, best_auc)

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    logger.info("训练样本 %d（正例占比 %.3f），验证样本 %d", len(train_set), pos_ratio, len(valid_set))

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (_, enc, y) in enumerate(train_loader):
            enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logit = model(**enc)
            loss = criterion(logit.float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())

        auc, n = validate(model.module, valid_loader, device, world_size)
        logger.info("epoch %d 验证 AUC=%.4f（%d 条），耗时 %.0fs", epoch, auc, n, time.time() - t0)

        if rank == 0:
            is_best = auc > best_auc
            best_auc = max(auc, best_auc)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_auc": best_auc}
            torch.save(state, os.path.join(args.output, "last.pt"))
            if is_best:
                torch.save(model.module.state_dict(), os.path.join(args.output, "best_model.pt"))
                logger.info("AUC 提升，保存最优模型")
        dist.barrier()

    logger.info("训练完成，最优 AUC=%.4f", best_auc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
