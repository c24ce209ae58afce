# -*- coding: utf-8 -*-
"""
智能客服意图识别（~60 个意图），chinese-roberta-wwm-ext 微调
按验证集 macro-F1 选最优模型，导出给线上推理服务。

    torchrun --nproc_per_node=4 07_intent_cls.py --conf configs/intent_v3.json
"""
import argparse
import json
import logging
import os
import random
import shutil

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_scheduler

logger = logging.getLogger("intent")


class Config:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        self.model_dir = d["model_dir"]
        self.train_csv = d["train_csv"]
        self.dev_csv = d["dev_csv"]
        self.label_file = d["label_file"]  # 每行一个意图名，顺序固定
        self.out_dir = d.get("out_dir", "outputs/intent")
        self.max_len = d.get("max_len", 64)
        self.batch_size = d.get("batch_size", 64)
        self.lr = d.get("lr", 3e-5)
        self.epochs = d.get("epochs", 5)
        self.warmup = d.get("warmup", 0.06)
        self.label_smoothing = d.get("label_smoothing", 0.1)
        self.seed = d.get("seed", 11)


class IntentDataset(Dataset):
    def __init__(self, csv_path, label2id, tokenizer, max_len):
        df = pd.read_csv(csv_path)  # 列: query, intent
        df = df.dropna(subset=["query", "intent"])
        df = df[df["intent"].isin(label2id)]
        self.texts = df["query"].astype(str).str.strip().tolist()
        self.labels = [label2id[x] for x in df["intent"]]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i]

    def collate(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        labels = batch.pop("labels")
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits
        y_pred.extend(logits.argmax(-1).cpu().tolist())
        y_true.extend(labels.tolist())
    model.train()
    acc = accuracy_score(y_true, y_pred)
    macro_f1 = f1_score(y_true, y_pred, average="macro")
    return acc, macro_f1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--conf", required=True)
    cfg = Config(parser.parse_args().conf)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    seed_all(cfg.seed)

    with open(cfg.label_file, encoding="utf-8") as f:
        intents = [line.strip() for line in f if line.strip()]
    label2id = {x: i for i, x in enumerate(intents)}

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
    train_ds = IntentDataset(cfg.train_csv, label2id, tokenizer, cfg.max_len)
    dev_ds = IntentDataset(cfg.dev_csv, label2id, tokenizer, cfg.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              collate_fn=train_ds.collate, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=128, sampler=dev_sampler, collate_fn=dev_ds.collate)

    model = AutoModelForSequenceClassification.from_pretrained(
        cfg.model_dir, num_labels=len(intents),
        id2label={i: x for x, i in label2id.items()}, label2id=label2id,
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    num_steps = cfg.epochs * len(train_loader)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(cfg.warmup * num_steps),
                              num_training_steps=num_steps)

    logger.info("意图数 %d | 训练 %d | 验证 %d | world_size %d", len(intents), len(train_ds), len(dev_ds), world_size)
    best_f1 = -1.0
    step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            logits = model(**batch).logits
            loss = F.cross_entropy(logits, labels, label_smoothing=cfg.label_smoothing)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                logger.info("epoch=%d step=%d/%d loss=%.4f", epoch, step, num_steps, loss.item())

        acc, macro_f1 = evaluate(model, dev_loader, device)
        if rank == 0:
            logger.info("epoch %d | dev acc %.4f | macro-F1 %.4f", epoch, acc, macro_f1)
            if macro_f1 > best_f1:
                best_f1 = macro_f1
                best_dir = os.path.join(cfg.out_dir, "best")
                if os.path.exists(best_dir):
                    shutil.rmtree(best_dir)
                os.makedirs(best_dir)
                model.module.save_pretrained(best_dir)
                tokenizer.save_pretrained(best_dir)
                with open(os.path.join(best_dir, "eval_result.json"), "w", encoding="utf-8") as f:
                    json.dump({"epoch": epoch, "acc": acc, "macro_f1": macro_f1}, f, ensure_ascii=False)
                logger.info("最优模型已更新 -> %s", best_dir)
        dist.barrier()

    logger.info("训练结束, best macro-F1 = %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
