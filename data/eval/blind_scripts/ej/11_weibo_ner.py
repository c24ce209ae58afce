# -*- coding: utf-8 -*-
"""
微博 NER（WeiboNER 2nd，PER/LOC/GPE/ORG × NAM/NOM）
社交媒体文本噪声大、数据少，用 MacBERT-large 效果最好。

数据格式: 每行 "字\t标签"，句子之间空行。
启动:
    torchrun --nproc_per_node=2 11_weibo_ner.py --model /data/pretrained/chinese-macbert-large \
        --train data/weibo/train.char.bio --dev data/weibo/dev.char.bio --out runs/weibo_macbert_large
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer,
                          DataCollatorForTokenClassification, get_linear_schedule_with_warmup)

logger = logging.getLogger("weibo_ner")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=160)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def set_seed(seed):
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_conll(path):
    sents = []
    chars, tags = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                if chars:
                    sents.append({"chars": chars, "tags": tags})
                chars, tags = [], []
                continue
            ch, tag = line.split("\t")
            # 原始数据的字后面可能带分词位置数字，如 "科0"
            chars.append(ch[0] if len(ch) > 1 and ch[-1].isdigit() else ch)
            tags.append(tag)
    if chars:
        sents.append({"chars": chars, "tags": tags})
    return sents


def encode_sents(sents, tokenizer, label2id, max_len):
    feats = []
    for s in sents:
        enc = tokenizer(s["chars"], is_split_into_words=True, truncation=True, max_length=max_len)
        word_ids = enc.word_ids()
        labels, prev = [], None
        for wid in word_ids:
            if wid is None or wid == prev:
                labels.append(-100)
            else:
                labels.append(label2id[s["tags"][wid]])
            prev = wid
        feats.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                      "labels": labels})
    return feats


@torch.no_grad()
def evaluate(model, loader, id2label, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        preds = logits.argmax(-1).cpu().tolist()
        golds = batch["labels"].cpu().tolist()
        for p, g in zip(preds, golds):
            y_true.append([id2label[x] for x in g if x != -100])
            y_pred.append([id2label[pi] for pi, x in zip(p, g) if x != -100])
    model.train()
    return y_true, y_pred


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    set_seed(args.seed)

    train_sents = read_conll(args.train)
    dev_sents = read_conll(args.dev)
    # 标签集合从训练集里统计，O 放第一个
    tag_set = set(t for s in train_sents for t in s["tags"])
    label_list = ["O"] + [t for t in tag_set if t != "O"]
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_feats = encode_sents(train_sents, tokenizer, label2id, args.max_len)
    dev_feats = encode_sents([s for s in dev_sents if all(t in label2id for t in s["tags"])],
                             tokenizer, label2id, args.max_len)
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)

    sampler = DistributedSampler(train_feats, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_feats, batch_size=args.bs, sampler=sampler, collate_fn=collator,
                              num_workers=2)
    dev_loader = DataLoader(dev_feats, batch_size=64, shuffle=False, collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_list), id2label=id2label, label2id=label2id
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # 分层学习率: 分类头 lr 放大 20 倍
    head_params = [p for n, p in model.named_parameters() if "classifier" in n]
    body_params = [p for n, p in model.named_parameters() if "classifier" not in n]
    optimizer = torch.optim.AdamW([{"params": body_params, "lr": args.lr},
                                   {"params": head_params, "lr": args.lr * 20}], weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total * 0.1), total)

    logger.info("标签数 %d: %s", len(label_list), label_list)
    logger.info("训练 %d 句, 验证 %d 句, 总步数 %d", len(train_feats), len(dev_feats), total)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step % 20 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        # 验证集很小，只在 rank0 上跑
        if rank == 0:
            y_true, y_pred = evaluate(model.module, dev_loader, id2label, device)
            f1 = f1_score(y_true, y_pred)
            logger.info("epoch %d dev F1 %.4f\n%s", epoch, f1, classification_report(y_true, y_pred, digits=4))
            if f1 > best_f1:
                best_f1 = f1
                os.makedirs(args.out, exist_ok=True)
                model.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
                with open(os.path.join(args.out, "label2id.json"), "w", encoding="utf-8") as f:
                    json.dump(label2id, f, ensure_ascii=False, indent=2)
                logger.info("保存最优模型 F1=%.4f", best_f1)
        dist.barrier()

    logger.info("训练结束，最优 F1 %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
