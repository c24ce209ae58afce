# -*- coding: utf-8 -*-
"""
人民日报 1998 NER（PER/LOC/ORG），BERT + BiLSTM + CRF
带 early stopping，dev F1 连续 patience 个 epoch 不涨就停。

    torchrun --nproc_per_node=4 19_peoples_daily_ner.py --bert_dir /opt/models/bert-base-chinese \
        --data_dir data/people_daily --save_dir ckpt/pd_bilstm_crf --epochs 30 --patience 3
"""
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchcrf import CRF
from transformers import BertModel, BertTokenizerFast, get_constant_schedule_with_warmup

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
TAG2ID = {t: i for i, t in enumerate(TAGS)}

logger = logging.getLogger("people_daily")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--bert_dir", required=True)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--max_len", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--bert_lr", type=float, default=2e-5)
    p.add_argument("--other_lr", type=float, default=1e-3)
    p.add_argument("--lstm_hidden", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def read_data(path):
    """每行 '字 标签'，空行分隔句子"""
    data, chars, tags = [], [], []
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if not line:
            if chars:
                data.append((chars, tags))
            chars, tags = [], []
            continue
        c, t = line.split(" ")
        chars.append(c)
        tags.append(t)
    if chars:
        data.append((chars, tags))
    return data


class NerData(Dataset):
    def __init__(self, data, tokenizer, max_len):
        self.samples = []
        for chars, tags in data:
            chars, tags = chars[: max_len - 2], tags[: max_len - 2]
            ids = tokenizer.convert_tokens_to_ids(["[CLS]"] + chars + ["[SEP]"])
            tag_ids = [0] + [TAG2ID[t] for t in tags] + [0]
            self.samples.append((ids, tag_ids))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def pad_batch(batch):
    n = max(len(x[0]) for x in batch)
    ids = torch.tensor([x[0] + [0] * (n - len(x[0])) for x in batch])
    tags = torch.tensor([x[1] + [0] * (n - len(x[1])) for x in batch])
    mask = torch.tensor([[1] * len(x[0]) + [0] * (n - len(x[0])) for x in batch], dtype=torch.bool)
    return ids, tags, mask


class BertBiLstmCrf(nn.Module):
    def __init__(self, bert_dir, lstm_hidden, num_tags):
        super().__init__()
        self.bert = BertModel.from_pretrained(bert_dir, add_pooling_layer=False)
        self.lstm = nn.LSTM(self.bert.config.hidden_size, lstm_hidden, num_layers=1,
                            batch_first=True, bidirectional=True)
        self.dropout = nn.Dropout(0.3)
        self.fc = nn.Linear(lstm_hidden * 2, num_tags)
        self.crf = CRF(num_tags, batch_first=True)

    def emissions(self, ids, mask):
        h = self.bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        h, _ = self.lstm(h)
        return self.fc(self.dropout(h))

    def forward(self, ids, mask, tags):
        return -self.crf(self.emissions(ids, mask), tags, mask=mask, reduction="mean")

    def predict(self, ids, mask):
        return self.crf.decode(self.emissions(ids, mask), mask=mask)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    y_true, y_pred = [], []
    for ids, tags, mask in loader:
        paths = model.predict(ids.to(device), mask.to(device))
        for path, t, m in zip(paths, tags, mask):
            n = int(m.sum())
            y_pred.append([TAGS[x] for x in path[1: n - 1]])
            y_true.append([TAGS[x] for x in t[1: n - 1].tolist()])
    model.train()
    return precision_score(y_true, y_pred), recall_score(y_true, y_pred), f1_score(y_true, y_pred)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(levelname)s | %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = BertTokenizerFast.from_pretrained(args.bert_dir)
    train_set = NerData(read_data(os.path.join(args.data_dir, "example.train")), tokenizer, args.max_len)
    dev_set = NerData(read_data(os.path.join(args.data_dir, "example.dev")), tokenizer, args.max_len)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=pad_batch, num_workers=2, pin_memory=True)
    dev_loader = DataLoader(dev_set, batch_size=64, shuffle=False, collate_fn=pad_batch)

    model = BertBiLstmCrf(args.bert_dir, args.lstm_hidden, len(TAGS)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    bert_params = list(model.module.bert.parameters())
    bert_ids = {id(p) for p in bert_params}
    other_params = [p for p in model.parameters() if id(p) not in bert_ids]
    optimizer = torch.optim.AdamW([
        {"params": bert_params, "lr": args.bert_lr},
        {"params": other_params, "lr": args.other_lr},
    ], weight_decay=0.01)
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=len(train_loader))

    logger.info("训练句子 %d，验证句子 %d，每卡 %d 步/epoch", len(train_set), len(dev_set), len(train_loader))
    best_f1, bad_epochs = 0.0, 0
    os.makedirs(args.save_dir, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total_loss = 0.0
        for step, (ids, tags, mask) in enumerate(train_loader):
            ids, tags, mask = ids.to(device), tags.to(device), mask.to(device)
            loss = model(ids, mask, tags)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            total_loss += loss.item()
        logger.info("epoch %d 平均 loss %.4f", epoch, total_loss / max(len(train_loader), 1))

        # dev 集只有几千句，rank0 单卡跑完整验证
        if rank == 0:
            p, r, f1 = evaluate(model.module, dev_loader, device)
            logger.info("epoch %d dev P %.4f R %.4f F1 %.4f", epoch, p, r, f1)
            if f1 > best_f1:
                best_f1, bad_epochs = f1, 0
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pt"))
                logger.info("F1 提升，已保存")
            else:
                bad_epochs += 1
                logger.info("F1 未提升 (%d/%d)", bad_epochs, args.patience)
                if bad_epochs >= args.patience:
                    logger.info("触发 early stopping，停止训练")
                    break
        dist.barrier()

    logger.info("best dev F1 %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
