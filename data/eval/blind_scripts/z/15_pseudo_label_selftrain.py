# -*- coding: utf-8 -*-
"""
新闻标题分类：自训练（self-training）第二阶段。
教师模型（上一轮在标注集上训好的 BERT）对无标注标题在线打伪标签，
只保留置信度 >= 阈值的样本训练学生模型；每个 epoch 在标注验证集上评估，保存最优学生。

torchrun --nproc_per_node=8 15_pseudo_label_selftrain.py \
    --teacher ckpt/teacher_round1 --unlabeled data/unlabeled_titles.txt --dev data/dev.tsv
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="伪标签自训练")
    parser.add_argument("--teacher", required=True, help="教师模型目录（save_pretrained 格式）")
    parser.add_argument("--student-init", default="hfl/chinese-macbert-base")
    parser.add_argument("--unlabeled", required=True, help="每行一个标题")
    parser.add_argument("--dev", required=True, help="tsv: 标题\\t标签id")
    parser.add_argument("--num-labels", type=int, default=15)
    parser.add_argument("--threshold", type=float, default=0.95, help="伪标签置信度阈值")
    parser.add_argument("--max-len", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--output", default="ckpt/student_round2")
    return parser.parse_args()


class TextDataset(Dataset):
    def __init__(self, texts, labels=None):
        self.texts = texts
        self.labels = labels

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], (self.labels[i] if self.labels is not None else -1)


def read_unlabeled(path):
    with open(path, encoding="utf-8") as f:
        return [l.strip() for l in f if l.strip()]


def read_dev(path):
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            t, y = line.rstrip("\n").split("\t")
            texts.append(t)
            labels.append(int(y))
    return texts, labels


class Collate:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stat = torch.zeros(2, device=device)
    for batch in loader:
        labels = batch.pop("labels").to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
        pred = model(**batch).logits.argmax(-1)
        stat[0] += (pred == labels).sum()
        stat[1] += labels.numel()
    dist.all_reduce(stat)
    return (stat[0] / stat[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO if rank == 0 else logging.ERROR)

    # 教师和学生是同一个底座（macbert-base），共用分词器
    tok = AutoTokenizer.from_pretrained(args.student_init)
    collate = Collate(tok, args.max_len)

    # 教师模型只做推理，不需要 DDP
    teacher = AutoModelForSequenceClassification.from_pretrained(args.teacher).to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = AutoModelForSequenceClassification.from_pretrained(args.student_init, num_labels=args.num_labels)
    student = DDP(student.to(device), device_ids=[local_rank])

    unl_set = TextDataset(read_unlabeled(args.unlabeled))
    dev_texts, dev_labels = read_dev(args.dev)
    dev_set = TextDataset(dev_texts, dev_labels)
    unl_sampler = DistributedSampler(unl_set, shuffle=True, seed=123)
    unl_loader = DataLoader(unl_set, batch_size=args.batch_size, sampler=unl_sampler, collate_fn=collate,
                            num_workers=4, pin_memory=True, drop_last=True)
    dev_idx = list(range(rank, len(dev_set), world_size))
    dev_loader = DataLoader(torch.utils.data.Subset(dev_set, dev_idx), batch_size=256, collate_fn=collate,
                            num_workers=2)

    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(unl_loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.05 * total), total)

    logger.info("无标注样本 %d 条，验证集 %d 条，每个 epoch %d 步", len(unl_set), len(dev_set), len(unl_loader))
    best_acc = 0.0
    for epoch in range(args.epochs):
        unl_sampler.set_epoch(epoch)
        student.train()
        kept, seen, t0 = 0, 0, time.time()
        for step, batch in enumerate(unl_loader):
            batch.pop("labels")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                t_prob = F.softmax(teacher(**batch).logits.float(), dim=-1)
            conf, pseudo = t_prob.max(dim=-1)
            mask = conf >= args.threshold
            seen += mask.numel()
            if mask.sum() == 0:
                continue
            kept += mask.sum().item()

            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = student(**batch).logits
            loss = (F.cross_entropy(logits.float(), pseudo, reduction="none") * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            scheduler.step()

            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.4f 伪标签保留率 %.3f 耗时 %.0fs",
                            epoch, step, loss.item(), kept / max(seen, 1), time.time() - t0)

        acc = evaluate(student.module, dev_loader, device)
        logger.info("epoch %d 验证集准确率 %.4f（本 epoch 保留伪标签 %d / %d）", epoch, acc, kept, seen)
        if rank == 0 and acc > best_acc:
            best_acc = acc
            student.module.save_pretrained(args.output)
            tok.save_pretrained(args.output)
            logger.info("保存最优学生模型 acc=%.4f -> %s", acc, args.output)
        dist.barrier()

    logger.info("自训练结束，最优验证集准确率 %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
