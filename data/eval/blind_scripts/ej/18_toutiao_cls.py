# -*- coding: utf-8 -*-
"""
今日头条新闻标题分类（toutiao-text-classfication-dataset，15 类）
标题 + 关键词 作为句对输入，ERNIE-3.0-base-zh (HF 版本)，wandb 记录实验。

    torchrun --nproc_per_node=4 18_toutiao_cls.py --model nghuyong/ernie-3.0-base-zh \
        --data /data/toutiao/toutiao_cat_data.txt --out runs/toutiao_ernie3 --wandb_project nlp-cls
"""
import argparse
import logging
import os
import random
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("toutiao")

# 数据里的类别 code -> 名称
CATEGORY = {
    "100": "民生", "101": "文化", "102": "娱乐", "103": "体育", "104": "财经",
    "106": "房产", "107": "汽车", "108": "教育", "109": "科技", "110": "军事",
    "112": "旅游", "113": "国际", "114": "证券", "115": "农业", "116": "电竞",
}
CODES = sorted(CATEGORY)
CODE2ID = {c: i for i, c in enumerate(CODES)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="nghuyong/ernie-3.0-base-zh")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--wandb_project", default="nlp-cls")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--dev_ratio", type=float, default=0.05)
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def load_toutiao(path):
    """格式: 6552431613437805063_!_102_!_news_entertainment_!_谢娜为李浩菲澄清网络谣言_!_佟丽娅,...."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("_!_")
            if len(parts) < 4 or parts[1] not in CODE2ID:
                continue
            title = parts[3]
            keywords = parts[4].replace(",", "，") if len(parts) > 4 else ""
            rows.append((title, keywords, CODE2ID[parts[1]]))
    return rows


def split_train_dev(rows, dev_ratio, seed):
    # 固定种子的独立 Random 对象，所有 rank 切出来完全一样
    rng = random.Random(seed)
    idx = list(range(len(rows)))
    rng.shuffle(idx)
    n_dev = int(len(rows) * dev_ratio)
    dev = [rows[i] for i in idx[:n_dev]]
    train = [rows[i] for i in idx[n_dev:]]
    return train, dev


class PairDataset(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def make_collate(tok, max_len):
    def _collate(batch):
        titles, kws, labels = zip(*batch)
        enc = tok(list(titles), list(kws), truncation="only_second", max_length=max_len,
                  padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc
    return _collate


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = batch["labels"].size(0)
        s[0] += out.loss * n
        s[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        s[2] += n
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    os.makedirs(args.out, exist_ok=True)
    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args),
               dir=args.out, tags=["toutiao", "ernie3"])

    rows = load_toutiao(args.data)
    train_rows, dev_rows = split_train_dev(rows, args.dev_ratio, args.seed)
    logger.info("总样本 %d，训练 %d，验证 %d", len(rows), len(train_rows), len(dev_rows))
    logger.info("类别分布: %s", {CATEGORY[CODES[k]]: v for k, v in Counter(r[2] for r in train_rows).items()})

    tok = AutoTokenizer.from_pretrained(args.model)
    collate = make_collate(tok, args.max_len)
    train_ds, dev_ds = PairDataset(train_rows), PairDataset(dev_rows)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=256, collate_fn=collate,
                            sampler=DistributedSampler(dev_ds, shuffle=False, drop_last=True))

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(CODES),
        id2label={i: CATEGORY[c] for i, c in enumerate(CODES)},
        label2id={CATEGORY[c]: i for i, c in enumerate(CODES)},
    ).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    best_acc, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0],
                           "train/grad_norm": grad_norm.item(), "epoch": epoch}, step=step)
            if step % 500 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, total, loss.item())

        dev_loss, dev_acc = evaluate(model, dev_loader, device)
        wandb.log({"dev/loss": dev_loss, "dev/acc": dev_acc}, step=step)
        logger.info("epoch %d dev loss %.4f acc %.4f", epoch, dev_loss, dev_acc)
        if rank == 0 and dev_acc > best_acc:
            best_acc = dev_acc
            save_dir = os.path.join(args.out, "best")
            model.module.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
            wandb.run.summary["best_dev_acc"] = best_acc
            logger.info("保存最优模型 acc=%.4f -> %s", best_acc, save_dir)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
