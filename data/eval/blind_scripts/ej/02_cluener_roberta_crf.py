# -*- coding: utf-8 -*-
"""
CLUENER2020 细粒度实体识别: chinese-roberta-wwm-ext + CRF
标注方案 BIOS，10 类实体。

    torchrun --nproc_per_node=8 02_cluener_roberta_crf.py \
        --model_name_or_path /mnt/models/chinese-roberta-wwm-ext \
        --data_dir /mnt/data/cluener --output_dir /mnt/exp/cluener_crf
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchcrf import CRF
from transformers import BertModel, BertTokenizerFast, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)

ENTITY_TYPES = ["address", "book", "company", "game", "government",
                "movie", "name", "organization", "position", "scene"]
LABELS = ["O"] + [f"{p}-{t}" for t in ENTITY_TYPES for p in ("B", "I", "S")]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}
ID2LABEL = {i: l for l, i in LABEL2ID.items()}


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--train_batch_size", type=int, default=32)
    parser.add_argument("--eval_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--crf_learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=5)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--logging_steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_cluener(path):
    """每行 {"text": ..., "label": {"name": {"叶老桂": [[9, 11]]}}} -> (chars, tags)"""
    examples = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            item = json.loads(line)
            chars = list(item["text"])
            tags = ["O"] * len(chars)
            for ent_type, ents in item.get("label", {}).items():
                for _, spans in ents.items():
                    for s, e in spans:
                        if s == e:
                            tags[s] = f"S-{ent_type}"
                        else:
                            tags[s] = f"B-{ent_type}"
                            for k in range(s + 1, e + 1):
                                tags[k] = f"I-{ent_type}"
            examples.append((chars, tags))
    return examples


class NerDataset(Dataset):
    def __init__(self, examples, tokenizer, max_len):
        self.features = []
        for chars, tags in examples:
            chars, tags = chars[: max_len - 2], tags[: max_len - 2]
            # 按字切分，直接逐字查词表，避免 wordpiece 对齐问题
            ids = [tokenizer.cls_token_id] + tokenizer.convert_tokens_to_ids(chars) + [tokenizer.sep_token_id]
            label_ids = [LABEL2ID["O"]] + [LABEL2ID[t] for t in tags] + [LABEL2ID["O"]]
            self.features.append((ids, label_ids))

    def __len__(self):
        return len(self.features)

    def __getitem__(self, idx):
        return self.features[idx]


def collate_fn(batch):
    max_len = max(len(x[0]) for x in batch)
    input_ids = torch.zeros(len(batch), max_len, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), max_len, dtype=torch.long)
    labels = torch.zeros(len(batch), max_len, dtype=torch.long)
    for i, (ids, lab) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, attention_mask, labels


class BertCrf(nn.Module):
    def __init__(self, model_path, num_labels, dropout=0.1):
        super().__init__()
        self.bert = BertModel.from_pretrained(model_path, add_pooling_layer=False)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(self.bert.config.hidden_size, num_labels)
        self.crf = CRF(num_labels, batch_first=True)

    def forward(self, input_ids, attention_mask, labels=None):
        seq = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        emissions = self.classifier(self.dropout(seq))
        mask = attention_mask.bool()
        if labels is not None:
            return -self.crf(emissions, labels, mask=mask, reduction="mean")
        return self.crf.decode(emissions, mask=mask)


def get_entities(tags):
    """BIOS 序列 -> {(type, start, end)}"""
    ents, start, ent_type = set(), -1, None
    for i, t in enumerate(tags + ["O"]):
        if t.startswith("S-"):
            ents.add((t[2:], i, i))
            start, ent_type = -1, None
        elif t.startswith("B-"):
            start, ent_type = i, t[2:]
        elif t.startswith("I-") and ent_type == t[2:]:
            if i == len(tags) - 1 or not tags[i + 1].startswith("I-"):
                ents.add((ent_type, start, i))
        else:
            start, ent_type = -1, None
    return ents


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(3, dtype=torch.long, device=device)  # tp, n_pred, n_gold
    for input_ids, attention_mask, labels in loader:
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        paths = model(input_ids, attention_mask)
        for path, lab, m in zip(paths, labels, attention_mask.cpu()):
            n = int(m.sum())
            pred = get_entities([ID2LABEL[x] for x in path[1: n - 1]])
            gold = get_entities([ID2LABEL[x] for x in lab[1: n - 1].tolist()])
            counts[0] += len(pred & gold)
            counts[1] += len(pred)
            counts[2] += len(gold)
    dist.all_reduce(counts)
    tp, n_pred, n_gold = counts.tolist()
    p = tp / max(n_pred, 1)
    r = tp / max(n_gold, 1)
    f1 = 2 * p * r / max(p + r, 1e-8)
    model.train()
    return p, r, f1


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format="[%(asctime)s][rank{}] %(message)s".format(rank),
                        level=logging.INFO if rank == 0 else logging.WARNING)
    seed_everything(args.seed)

    tokenizer = BertTokenizerFast.from_pretrained(args.model_name_or_path)
    train_set = NerDataset(read_cluener(os.path.join(args.data_dir, "train.json")), tokenizer, args.max_seq_length)
    dev_set = NerDataset(read_cluener(os.path.join(args.data_dir, "dev.json")), tokenizer, args.max_seq_length)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.train_batch_size, sampler=train_sampler,
                              collate_fn=collate_fn, num_workers=4, pin_memory=True)
    # 验证集按 rank 交错切分，不补齐，保证实体数统计不重复
    dev_shard = Subset(dev_set, list(range(rank, len(dev_set), world_size)))
    dev_loader = DataLoader(dev_shard, batch_size=args.eval_batch_size, collate_fn=collate_fn)

    model = BertCrf(args.model_name_or_path, len(LABELS)).to(device)

    no_decay = ["bias", "LayerNorm.weight"]
    bert_params = list(model.bert.named_parameters()) + list(model.classifier.named_parameters())
    optimizer_grouped_parameters = [
        {"params": [p for n, p in bert_params if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay, "lr": args.learning_rate},
        {"params": [p for n, p in bert_params if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0, "lr": args.learning_rate},
        # CRF 转移矩阵用大学习率
        {"params": model.crf.parameters(), "weight_decay": 0.0, "lr": args.crf_learning_rate},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    t_total = len(train_loader) * args.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(t_total * args.warmup_ratio), t_total)

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    logger.info("***** 开始训练 *****")
    logger.info("  样本数 = %d, 卡数 = %d, 单卡 batch = %d, 总步数 = %d",
                len(train_set), world_size, args.train_batch_size, t_total)

    best_f1, global_step = 0.0, 0
    for epoch in range(args.num_train_epochs):
        model.train()
        running = 0.0
        for step, (input_ids, attention_mask, labels) in enumerate(train_loader):
            input_ids = input_ids.to(device, non_blocking=True)
            attention_mask = attention_mask.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            loss = model(input_ids, attention_mask, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            running += loss.item()

            if global_step % args.logging_steps == 0:
                logger.info("epoch %d | step %d/%d | loss %.4f", epoch, global_step, t_total,
                            running / args.logging_steps)
                running = 0.0

        p, r, f1 = evaluate(model.module, dev_loader, device)
        logger.info("epoch %d 验证集: P=%.4f R=%.4f F1=%.4f", epoch, p, r, f1)
        if rank == 0 and f1 > best_f1:
            best_f1 = f1
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.output_dir, "pytorch_model.bin"))
            tokenizer.save_pretrained(args.output_dir)
            with open(os.path.join(args.output_dir, "label2id.json"), "w", encoding="utf-8") as f:
                json.dump(LABEL2ID, f, ensure_ascii=False, indent=2)
            logger.info("新的最优 F1=%.4f，模型已保存", best_f1)
        dist.barrier()

    logger.info("训练完成, best F1 = %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
