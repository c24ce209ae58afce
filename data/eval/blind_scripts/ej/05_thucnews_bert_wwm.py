# -*- coding: utf-8 -*-
# THUCNews 新闻十分类，chinese-bert-wwm-ext 微调，DDP 多卡
# 启动: torchrun --nproc_per_node=8 05_thucnews_bert_wwm.py --config conf/thucnews.yaml
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml
from sklearn.metrics import classification_report
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertForSequenceClassification, BertTokenizer, get_linear_schedule_with_warmup

CLASSES = ["体育", "财经", "房产", "家居", "教育", "科技", "时尚", "时政", "游戏", "娱乐"]

DEFAULT_CFG = {
    "pretrained": "/data/models/chinese-bert-wwm-ext",
    "train_path": "/data/thucnews/cnews.train.txt",
    "dev_path": "/data/thucnews/cnews.val.txt",
    "save_dir": "./checkpoints/thucnews_bert_wwm",
    "max_len": 256,
    "batch_size": 32,
    "lr": 2e-5,
    "epochs": 3,
    "warmup_ratio": 0.1,
    "fp16": True,
    "log_every": 100,
    "num_workers": 4,
}


def get_logger(rank):
    logger = logging.getLogger("thucnews")
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(h)
    return logger


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=str, default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


class CnewsDataset(Dataset):
    """cnews 格式: 标签\t正文"""

    def __init__(self, path, tokenizer, max_len):
        self.samples = []
        label2id = {c: i for i, c in enumerate(CLASSES)}
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t", 1)
                if len(parts) != 2:
                    continue
                label, content = parts
                # 正文很长，只取前面部分（标题+导语信息最多）
                self.samples.append((content[: max_len * 2], label2id[label]))
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        text, label = self.samples[idx]
        enc = self.tokenizer(text, max_length=self.max_len, truncation=True,
                             padding="max_length", return_tensors="pt")
        return {
            "input_ids": enc["input_ids"].squeeze(0),
            "attention_mask": enc["attention_mask"].squeeze(0),
            "token_type_ids": enc["token_type_ids"].squeeze(0),
            "labels": torch.tensor(label, dtype=torch.long),
        }


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    preds, golds = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        preds.append(logits.argmax(-1))
        golds.append(batch["labels"])
    preds, golds = torch.cat(preds), torch.cat(golds)
    # 各卡样本数一致（DistributedSampler drop_last），直接 all_gather
    all_preds = [torch.zeros_like(preds) for _ in range(world_size)]
    all_golds = [torch.zeros_like(golds) for _ in range(world_size)]
    dist.all_gather(all_preds, preds)
    dist.all_gather(all_golds, golds)
    model.train()
    return torch.cat(all_preds).cpu().numpy(), torch.cat(all_golds).cpu().numpy()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logger = get_logger(rank)
    torch.manual_seed(42)
    np.random.seed(42)

    tokenizer = BertTokenizer.from_pretrained(cfg["pretrained"])
    train_ds = CnewsDataset(cfg["train_path"], tokenizer, cfg["max_len"])
    dev_ds = CnewsDataset(cfg["dev_path"], tokenizer, cfg["max_len"])

    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], shuffle=True,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, sampler=dev_sampler, num_workers=cfg["num_workers"])

    model = BertForSequenceClassification.from_pretrained(cfg["pretrained"], num_labels=len(CLASSES))
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    params = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"])
    total_steps = len(train_loader) * cfg["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total_steps * cfg["warmup_ratio"]), total_steps)
    scaler = GradScaler(enabled=cfg["fp16"])

    logger.info(f"训练集 {len(train_ds)} 条, 验证集 {len(dev_ds)} 条, GPU 数 {world_size}, 总步数 {total_steps}")
    best_acc, step = 0.0, 0
    for epoch in range(cfg["epochs"]):
        model.train()
        tic = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with autocast(enabled=cfg["fp16"]):
                loss = model(**batch).loss
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % cfg["log_every"] == 0:
                logger.info(f"[epoch {epoch}] step {step}/{total_steps} loss={loss.item():.4f} "
                            f"lr={scheduler.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s")

        preds, golds = evaluate(model, dev_loader, device, world_size)
        acc = float((preds == golds).mean())
        logger.info(f"epoch {epoch} 验证集 acc = {acc:.4f}")
        if rank == 0:
            logger.info("\n" + classification_report(golds, preds, target_names=CLASSES, digits=4))
            if acc > best_acc:
                best_acc = acc
                os.makedirs(cfg["save_dir"], exist_ok=True)
                model.module.save_pretrained(cfg["save_dir"])
                tokenizer.save_pretrained(cfg["save_dir"])
                logger.info(f"保存最优模型到 {cfg['save_dir']} (acc={acc:.4f})")
        dist.barrier()

    logger.info(f"done. best acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
