# -*- coding: utf-8 -*-
"""
ChnSentiCorp + 外卖/电商评论 情感二分类
模型: hfl/chinese-roberta-wwm-ext-large

    torchrun --nproc_per_node=4 09_sentiment_roberta.py \
        --pretrained hfl/chinese-roberta-wwm-ext-large \
        --train_files data/chnsenticorp/train.tsv,data/waimai_10k/train.tsv \
        --dev_file data/chnsenticorp/dev.tsv --output_dir outputs/senti_large
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          get_polynomial_decay_schedule_with_warmup)

logger = logging.getLogger("senti")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained", type=str, default="hfl/chinese-roberta-wwm-ext-large")
    parser.add_argument("--train_files", type=str, required=True, help="逗号分隔的多个训练文件")
    parser.add_argument("--dev_file", type=str, required=True)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--max_len", type=int, default=160)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--eval_steps", type=int, default=1000)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seed", type=int, default=2024)
    return parser.parse_args()


class SentiDataset(Dataset):
    """tsv 两列: label \t text_a （ChnSentiCorp 原始格式）"""

    def __init__(self, path, tokenizer, max_len):
        self.data = []
        with open(path, encoding="utf-8") as f:
            header = f.readline()
            assert header.startswith("label"), f"{path} 表头不对: {header}"
            for line in f:
                label, text = line.rstrip("\n").split("\t", 1)
                text = text.replace("\u3000", " ").strip()
                if text:
                    self.data.append((text, int(label)))
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return self.data[idx]


def make_collate(tokenizer, max_len):
    def collate(batch):
        texts, labels = zip(*batch)
        enc = tokenizer(list(texts), truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc
    return collate


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    loss_sum = torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
            out = model(**batch)
        n = batch["labels"].size(0)
        loss_sum += out.loss.float() * n
        correct += (out.logits.argmax(-1) == batch["labels"]).sum()
        total += n
    for t in (correct, total, loss_sum):
        dist.all_reduce(t)
    model.train()
    return (correct / total).item(), (loss_sum / total).item()


def save_model(model, tokenizer, output_dir, tag):
    save_dir = os.path.join(output_dir, tag)
    os.makedirs(save_dir, exist_ok=True)
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    logger.info("模型已保存: %s", save_dir)


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.pretrained)
    train_ds = ConcatDataset([SentiDataset(p, tokenizer, args.max_len) for p in args.train_files.split(",")])
    dev_ds = SentiDataset(args.dev_file, tokenizer, args.max_len)
    collate = make_collate(tokenizer, args.max_len)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, sampler=dev_sampler, collate_fn=collate)

    model = AutoModelForSequenceClassification.from_pretrained(args.pretrained, num_labels=2).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup_steps, total_steps, lr_end=1e-7)
    amp_dtype = torch.bfloat16 if args.bf16 else None

    logger.info("训练集 %d 条，验证集 %d 条，%d 卡，每卡 batch %d，共 %d 步",
                len(train_ds), len(dev_ds), world_size, args.batch_size, total_steps)

    best_acc = 0.0
    global_step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 50 == 0:
                logger.info("ep %d | step %d/%d | loss %.4f | lr %.3e | %.1f min", epoch, global_step,
                            total_steps, loss.item(), scheduler.get_last_lr()[0], (time.time() - t0) / 60)

            if global_step % args.eval_steps == 0:
                acc, dev_loss = evaluate(model, dev_loader, device, amp_dtype)
                logger.info("[eval] step %d | dev_acc %.4f | dev_loss %.4f", global_step, acc, dev_loss)
                if rank == 0 and acc > best_acc:
                    best_acc = acc
                    save_model(model, tokenizer, args.output_dir, "best")
                dist.barrier()

    acc, dev_loss = evaluate(model, dev_loader, device, amp_dtype)
    logger.info("[final] dev_acc %.4f | dev_loss %.4f | best %.4f", acc, dev_loss, max(acc, best_acc))
    if rank == 0:
        save_model(model, tokenizer, args.output_dir, "last")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
