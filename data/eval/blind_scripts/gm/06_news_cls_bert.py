# -*- coding: utf-8 -*-
"""
资讯内容分类（一级类目，~30 类）BERT 微调

- 长文本（标题 + 正文前 510 字），显存吃紧，开启 gradient checkpointing
- 梯度累积：accum_steps 个 micro-batch 才同步一次梯度
启动（老集群镜像还是用 launch）：
    python -m torch.distributed.launch --nproc_per_node=8 --master_port=29600 06_news_cls_bert.py \
        --data_dir /mnt/nas/content/news_cls/v5 --output_dir /mnt/nas/content/news_cls/exp/bert_base_v5
"""
import os
import json
import time
import random
import argparse
import logging
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertTokenizerFast, BertForSequenceClassification, get_cosine_schedule_with_warmup
from sklearn.metrics import f1_score, accuracy_score

logger = logging.getLogger(__name__)


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", type=str, required=True)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--model_path", type=str, default="/mnt/nas/models/bert-base-chinese")
    parser.add_argument("--max_len", type=int, default=512)
    parser.add_argument("--per_gpu_batch_size", type=int, default=16)
    parser.add_argument("--accum_steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=2023)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                        help="torch.distributed.launch 自动传入")
    return parser


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class NewsDataset(Dataset):
    def __init__(self, path, label2id, tokenizer, max_len):
        self.samples = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                self.samples.append((d["title"], d["content"][:max_len], label2id[d["category"]]))
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        title, content, label = self.samples[idx]
        enc = self.tok(title, content, max_length=self.max_len, truncation="only_second", padding="max_length")
        return {"input_ids": torch.tensor(enc["input_ids"]),
                "attention_mask": torch.tensor(enc["attention_mask"]),
                "token_type_ids": torch.tensor(enc["token_type_ids"]),
                "labels": torch.tensor(label)}


@torch.no_grad()
def evaluate(model, dataset, args, device):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = Subset(dataset, list(range(rank, len(dataset), world)))
    loader = DataLoader(shard, batch_size=args.per_gpu_batch_size * 2, num_workers=2)
    preds, golds = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model.module(**batch).logits
        preds.extend(logits.argmax(-1).tolist())
        golds.extend(batch["labels"].tolist())
    gathered = [None for _ in range(world)]
    dist.all_gather_object(gathered, (preds, golds))
    model.train()
    all_preds = [p for g in gathered for p in g[0]]
    all_golds = [y for g in gathered for y in g[1]]
    return accuracy_score(all_golds, all_preds), f1_score(all_golds, all_preds, average="macro")


def main():
    args = get_parser().parse_args()
    # 新版 launch 同时设置了 LOCAL_RANK 环境变量，优先用环境变量
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    set_seed(args.seed)

    with open(os.path.join(args.data_dir, "label_list.txt"), encoding="utf-8") as f:
        labels = [l.strip() for l in f if l.strip()]
    label2id = {l: i for i, l in enumerate(labels)}

    tokenizer = BertTokenizerFast.from_pretrained(args.model_path)
    train_set = NewsDataset(os.path.join(args.data_dir, "train.jsonl"), label2id, tokenizer, args.max_len)
    dev_set = NewsDataset(os.path.join(args.data_dir, "dev.jsonl"), label2id, tokenizer, args.max_len)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.per_gpu_batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)

    model = BertForSequenceClassification.from_pretrained(args.model_path, num_labels=len(labels))
    # 非 reentrant 的 checkpoint 和 DDP 配合没有问题
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank, find_unused_parameters=False)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates_per_epoch = len(train_loader) // args.accum_steps
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(total_updates * args.warmup_ratio), total_updates)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    logger.info("全局 batch = %d x %d x %d = %d, 总更新步数 %d", args.per_gpu_batch_size, args.accum_steps,
                world_size, args.per_gpu_batch_size * args.accum_steps * world_size, total_updates)

    best_f1, update_step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            if i >= updates_per_epoch * args.accum_steps:
                break  # 每个 rank 的 len(train_loader) 相同，尾部不足一个累积周期的丢掉
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            is_update = (i + 1) % args.accum_steps == 0
            # 非更新步跳过梯度 all-reduce
            ctx = model.no_sync() if not is_update else nullcontext()
            with ctx:
                with torch.cuda.amp.autocast(enabled=args.fp16):
                    loss = model(**batch).loss / args.accum_steps
                scaler.scale(loss).backward()
            if is_update:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                update_step += 1
                if update_step % 20 == 0:
                    logger.info("epoch %d update %d/%d loss %.4f lr %.2e %.1fs", epoch, update_step, total_updates,
                                loss.item() * args.accum_steps, scheduler.get_last_lr()[0], time.time() - t0)
                    t0 = time.time()

        acc, f1 = evaluate(model, dev_set, args, device)
        logger.info("epoch %d dev acc %.4f macro-F1 %.4f", epoch, acc, f1)
        if rank == 0 and f1 > best_f1:
            best_f1 = f1
            save_dir = os.path.join(args.output_dir, "best")
            os.makedirs(save_dir, exist_ok=True)
            model.module.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
            with open(os.path.join(save_dir, "label_list.txt"), "w", encoding="utf-8") as f:
                f.write("\n".join(labels))
            logger.info("保存最优模型到 %s", save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
