# -*- coding: utf-8 -*-
"""
AFQMC 蚂蚁金融语义相似度（句对二分类），交互式 BERT 匹配模型
加了 R-Drop 正则，线下 dev 大概 +0.8 个点。

启动:
    torchrun --nproc_per_node=4 10_afqmc_match.py --model_path ./pretrained/chinese-roberta-wwm-ext \
        --data_dir ./data/afqmc --output_dir ./output/afqmc_rdrop
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertForSequenceClassification, BertTokenizer, get_linear_schedule_with_warmup

logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s", level=logging.INFO)
logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_path", type=str, required=True)
    parser.add_argument("--data_dir", type=str, required=True)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--max_seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--warmup_proportion", type=float, default=0.1)
    parser.add_argument("--rdrop_alpha", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class AfqmcDataset(Dataset):
    """CLUE 格式: {"sentence1": ..., "sentence2": ..., "label": "0"}"""

    def __init__(self, file_path, tokenizer, max_seq_len):
        self.examples = []
        with open(file_path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                enc = tokenizer.encode_plus(d["sentence1"], d["sentence2"], max_length=max_seq_len,
                                            truncation=True)
                self.examples.append((enc["input_ids"], enc["token_type_ids"], int(d["label"])))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


def collate_fn(batch):
    max_len = max(len(x[0]) for x in batch)
    input_ids, token_type_ids, attention_mask, labels = [], [], [], []
    for ids, tt, label in batch:
        pad = max_len - len(ids)
        input_ids.append(ids + [0] * pad)
        token_type_ids.append(tt + [0] * pad)
        attention_mask.append([1] * len(ids) + [0] * pad)
        labels.append(label)
    return (torch.tensor(input_ids), torch.tensor(token_type_ids),
            torch.tensor(attention_mask), torch.tensor(labels))


def compute_kl_loss(p, q):
    p_loss = F.kl_div(F.log_softmax(p, dim=-1), F.softmax(q, dim=-1), reduction="batchmean")
    q_loss = F.kl_div(F.log_softmax(q, dim=-1), F.softmax(p, dim=-1), reduction="batchmean")
    return (p_loss + q_loss) / 2


@torch.no_grad()
def evaluate(model, dataloader, device):
    model.eval()
    correct = torch.tensor(0, device=device)
    total = torch.tensor(0, device=device)
    for input_ids, token_type_ids, attention_mask, labels in dataloader:
        input_ids, token_type_ids = input_ids.to(device), token_type_ids.to(device)
        attention_mask, labels = attention_mask.to(device), labels.to(device)
        logits = model(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).logits
        correct += (logits.argmax(dim=-1) == labels).sum()
        total += labels.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return correct.item() / max(total.item(), 1)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)
    set_seed(args.seed)

    tokenizer = BertTokenizer.from_pretrained(args.model_path)
    train_dataset = AfqmcDataset(os.path.join(args.data_dir, "train.json"), tokenizer, args.max_seq_len)
    dev_dataset = AfqmcDataset(os.path.join(args.data_dir, "dev.json"), tokenizer, args.max_seq_len)

    train_sampler = DistributedSampler(train_dataset, shuffle=True)
    dev_sampler = DistributedSampler(dev_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate_fn, num_workers=2, pin_memory=True)
    dev_loader = DataLoader(dev_dataset, batch_size=64, sampler=dev_sampler, collate_fn=collate_fn)

    model = BertForSequenceClassification.from_pretrained(args.model_path, num_labels=2)
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    t_total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(t_total * args.warmup_proportion), t_total)

    logger.info("***** Running training *****")
    logger.info("  Num examples = %d, world_size = %d, total steps = %d", len(train_dataset), world_size, t_total)

    best_acc = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for input_ids, token_type_ids, attention_mask, labels in train_loader:
            input_ids, token_type_ids = input_ids.to(device), token_type_ids.to(device)
            attention_mask, labels = attention_mask.to(device), labels.to(device)
            # R-Drop: 同一个 batch 复制一份一起过，两次 dropout 不同
            logits = model(input_ids=input_ids.repeat(2, 1), token_type_ids=token_type_ids.repeat(2, 1),
                           attention_mask=attention_mask.repeat(2, 1)).logits
            logits1, logits2 = logits.chunk(2, dim=0)
            ce = (F.cross_entropy(logits1, labels) + F.cross_entropy(logits2, labels)) / 2
            loss = ce + args.rdrop_alpha * compute_kl_loss(logits1, logits2)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f (ce %.4f)", epoch, global_step, loss.item(), ce.item())

        acc = evaluate(model, dev_loader, device)
        logger.info("epoch %d dev acc: %.4f", epoch, acc)
        if rank == 0 and acc > best_acc:
            best_acc = acc
            os.makedirs(args.output_dir, exist_ok=True)
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            logger.info("best acc %.4f, model saved to %s", best_acc, args.output_dir)
        dist.barrier()

    logger.info("finished, best dev acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
