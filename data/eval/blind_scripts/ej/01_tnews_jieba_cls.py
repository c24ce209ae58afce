# -*- coding: utf-8 -*-
"""
TNEWS 今日头条短新闻分类 —— jieba 分词 + TextCNN 基线（多卡 DDP 版）

作为 BERT 模型上线前的对照基线，推理快，方便做线上 AB。

启动:
    torchrun --nproc_per_node=4 01_tnews_jieba_cls.py \
        --data_dir /data/nlp/clue/tnews --output_dir output/tnews_textcnn
"""
import argparse
import json
import logging
import os
import pickle
import random
import time
from collections import Counter

import jieba
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("tnews_textcnn")

PAD, UNK = "<pad>", "<unk>"
# TNEWS 标签 id 不连续（没有 105 和 111）
TNEWS_LABELS = ["100", "101", "102", "103", "104", "106", "107", "108",
                "109", "110", "112", "113", "114", "115", "116"]
LABEL2ID = {l: i for i, l in enumerate(TNEWS_LABELS)}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", type=str, required=True)
    p.add_argument("--output_dir", type=str, default="output/tnews_textcnn")
    p.add_argument("--user_dict", type=str, default=None, help="jieba 自定义词典")
    p.add_argument("--max_len", type=int, default=48)
    p.add_argument("--min_freq", type=int, default=2)
    p.add_argument("--max_vocab", type=int, default=80000)
    p.add_argument("--emb_dim", type=int, default=300)
    p.add_argument("--num_filters", type=int, default=256)
    p.add_argument("--kernel_sizes", type=str, default="2,3,4")
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--batch_size", type=int, default=128, help="单卡 batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=2023)
    p.add_argument("--overwrite_cache", action="store_true")
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


def read_jsonl(path):
    rows = []
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def build_vocab(token_lists, min_freq, max_size):
    counter = Counter()
    for toks in token_lists:
        counter.update(toks)
    itos = [PAD, UNK]
    for w, c in counter.most_common(max_size):
        if c < min_freq:
            break
        itos.append(w)
    return {w: i for i, w in enumerate(itos)}


def encode(tokens, vocab, max_len):
    ids = [vocab.get(t, 1) for t in tokens[:max_len]]
    return ids + [0] * (max_len - len(ids))


def load_features(args, split, vocab=None):
    """分词 + 转 id，结果缓存成 pkl，第二次起直接读缓存"""
    cache_file = os.path.join(args.data_dir, f"cached_{split}_jieba_{args.max_len}.pkl")
    if os.path.exists(cache_file) and not args.overwrite_cache:
        logger.info("读取缓存特征: %s", cache_file)
        with open(cache_file, "rb") as f:
            return pickle.load(f)

    logger.info("缓存不存在，开始 jieba 分词: %s", split)
    if args.user_dict:
        jieba.load_userdict(args.user_dict)
    rows = read_jsonl(os.path.join(args.data_dir, f"{split}.json"))
    token_lists = []
    for r in rows:
        # 标题 + 关键词一起切
        text = r["sentence"] + " " + r.get("keywords", "").replace(",", " ")
        token_lists.append([w for w in jieba.lcut(text) if w.strip()])
    if vocab is None:
        vocab = build_vocab(token_lists, args.min_freq, args.max_vocab)
    features = {
        "input_ids": [encode(t, vocab, args.max_len) for t in token_lists],
        "labels": [LABEL2ID[r["label"]] for r in rows],
        "vocab": vocab,
    }
    with open(cache_file, "wb") as f:
        pickle.dump(features, f)
    logger.info("%s 分词完成，共 %d 条，词表 %d", split, len(rows), len(vocab))
    return features


class TnewsDataset(Dataset):
    def __init__(self, feats):
        self.input_ids = feats["input_ids"]
        self.labels = feats["labels"]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        return (torch.tensor(self.input_ids[idx], dtype=torch.long),
                torch.tensor(self.labels[idx], dtype=torch.long))


class TextCNN(nn.Module):
    def __init__(self, vocab_size, emb_dim, num_filters, kernel_sizes, num_classes, dropout):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(emb_dim, num_filters, k) for k in kernel_sizes])
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(num_filters * len(kernel_sizes), num_classes)

    def forward(self, input_ids):
        x = self.embedding(input_ids).transpose(1, 2)  # [B, E, L]
        pooled = [F.max_pool1d(F.relu(conv(x)), x.size(2) - conv.kernel_size[0] + 1).squeeze(2)
                  for conv in self.convs]
        h = self.dropout(torch.cat(pooled, dim=1))
        return self.fc(h)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, total
    for input_ids, labels in loader:
        input_ids, labels = input_ids.to(device), labels.to(device)
        logits = model(input_ids)
        stats[0] += F.cross_entropy(logits, labels, reduction="sum")
        stats[1] += (logits.argmax(-1) == labels).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank, rank, world_size = setup_distributed()
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        level=logging.INFO if rank == 0 else logging.WARN,
    )
    set_seed(args.seed)
    device = torch.device("cuda", local_rank)

    train_feats = load_features(args, "train")
    dev_feats = load_features(args, "dev", vocab=train_feats["vocab"])
    vocab = train_feats["vocab"]

    train_ds, dev_ds = TnewsDataset(train_feats), TnewsDataset(dev_feats)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=256, sampler=dev_sampler, num_workers=args.num_workers)

    kernel_sizes = [int(k) for k in args.kernel_sizes.split(",")]
    model = TextCNN(len(vocab), args.emb_dim, args.num_filters, kernel_sizes,
                    len(TNEWS_LABELS), args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        logger.info("训练样本 %d，验证样本 %d，卡数 %d", len(train_ds), len(dev_ds), world_size)

    best_acc = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (input_ids, labels) in enumerate(train_loader):
            input_ids = input_ids.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = model(input_ids)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            global_step += 1
            if rank == 0 and global_step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, global_step,
                            loss.item(), optimizer.param_groups[0]["lr"])
        scheduler.step()

        dev_loss, dev_acc = evaluate(model, dev_loader, device)
        if rank == 0:
            logger.info("epoch %d 完成，用时 %.1fs，dev_loss %.4f dev_acc %.4f",
                        epoch, time.time() - t0, dev_loss, dev_acc)
            if dev_acc > best_acc:
                best_acc = dev_acc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best_textcnn.pt"))
                logger.info("保存最优模型, acc=%.4f", best_acc)
        dist.barrier()

    if rank == 0:
        logger.info("训练结束，最优 dev_acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
