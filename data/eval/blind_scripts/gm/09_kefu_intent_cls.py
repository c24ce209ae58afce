# -*- coding: utf-8 -*-
"""
智能客服意图识别模型训练

数据来自客服日志标注平台导出的 tsv：  文本 \t 意图标签
意图体系会随业务迭代增删，因此标签表直接从训练数据里统计，不再手工维护。

启动：
    torchrun --nproc_per_node=8 09_kefu_intent_cls.py \
        --train /mnt/nas/kefu/intent/20240301/train.tsv \
        --dev /mnt/nas/kefu/intent/20240301/dev.tsv \
        --save_dir /mnt/nas/kefu/intent/models/20240301
"""
import os
import json
import time
import argparse
import logging

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, AutoModelForSequenceClassification, get_linear_schedule_with_warmup

logger = logging.getLogger("intent")


def parse_args():
    parser = argparse.ArgumentParser(description="客服意图分类")
    parser.add_argument("--train", required=True)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--pretrained", default="/mnt/nas/models/chinese-macbert-base")
    parser.add_argument("--max_len", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--min_count", type=int, default=5, help="样本数少于该值的意图并入 other")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def read_tsv(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 2 or not parts[0].strip():
                continue
            rows.append((parts[0].strip(), parts[1].strip()))
    return rows


def build_label_map(rows, min_count):
    counter = {}
    for _, lab in rows:
        counter[lab] = counter.get(lab, 0) + 1
    intents = set(lab for lab, c in counter.items() if c >= min_count)
    intents.add("other")
    return {lab: i for i, lab in enumerate(intents)}


class IntentDataset(Dataset):
    def __init__(self, rows, label2id, tokenizer, max_len):
        self.texts = [r[0] for r in rows]
        self.labels = [label2id.get(r[1], label2id["other"]) for r in rows]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i]

    def collate(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), max_length=self.max_len, truncation=True, padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc


@torch.no_grad()
def evaluate(model, dev_set, device, batch_size):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(Subset(dev_set, range(rank, len(dev_set), world)), batch_size=batch_size,
                        collate_fn=dev_set.collate, num_workers=2)
    stat = torch.zeros(3, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model.module(**batch)
        stat[0] += out.loss * batch["labels"].size(0)
        stat[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        stat[2] += batch["labels"].size(0)
    dist.all_reduce(stat)
    model.train()
    return (stat[0] / stat[2]).item(), (stat[1] / stat[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    train_rows = read_tsv(args.train)
    dev_rows = read_tsv(args.dev)
    label2id = build_label_map(train_rows, args.min_count)
    logger.info("训练 %d 条, 验证 %d 条, 意图数 %d", len(train_rows), len(dev_rows), len(label2id))

    tokenizer = AutoTokenizer.from_pretrained(args.pretrained)
    train_set = IntentDataset(train_rows, label2id, tokenizer, args.max_len)
    dev_set = IntentDataset(dev_rows, label2id, tokenizer, args.max_len)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=train_set.collate, num_workers=4, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(args.pretrained, num_labels=len(label2id))
    model.config.id2label = {i: l for l, i in label2id.items()}
    model.config.label2id = label2id
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total * 0.1), total)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        with open(os.path.join(args.save_dir, "label2id.json"), "w", encoding="utf-8") as f:
            json.dump(label2id, f, ensure_ascii=False, indent=2)

    best_acc, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 50 == 0:
                logger.info("epoch %d step %d/%d loss %.4f (%.1fs)", epoch, step, total, loss.item(), time.time() - t0)
                t0 = time.time()

        dev_loss, dev_acc = evaluate(model, dev_set, device, args.batch_size * 2)
        logger.info("epoch %d dev_loss %.4f dev_acc %.4f", epoch, dev_loss, dev_acc)
        if rank == 0 and dev_acc > best_acc:
            best_acc = dev_acc
            model.module.save_pretrained(args.save_dir)
            tokenizer.save_pretrained(args.save_dir)
            logger.info("新的最优模型 acc=%.4f 已保存", best_acc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
