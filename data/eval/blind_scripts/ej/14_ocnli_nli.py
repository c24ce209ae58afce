# -*- coding: utf-8 -*-
"""
OCNLI 中文自然语言推理（entailment / neutral / contradiction）
chinese-roberta-wwm-ext-large，训练时间较长（集群会抢占），按 step 存 checkpoint 支持断点续训。

首次训练:
    torchrun --nproc_per_node=8 14_ocnli_nli.py --model_dir /mnt/models/chinese-roberta-wwm-ext-large \
        --data_dir /mnt/data/ocnli --output_dir /mnt/exp/ocnli_large
续训:
    torchrun --nproc_per_node=8 14_ocnli_nli.py ... --resume /mnt/exp/ocnli_large/last.pt
"""
import argparse
import json
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertForSequenceClassification, BertTokenizerFast, get_linear_schedule_with_warmup

LABEL_MAP = {"entailment": 0, "neutral": 1, "contradiction": 2}
logger = logging.getLogger("ocnli")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_dir", required=True)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resume", default=None, help="checkpoint 路径")
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class OcnliDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.items = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                if d.get("label") not in LABEL_MAP:  # 去掉 "-" 这种无共识样本
                    continue
                enc = tokenizer(d["sentence1"], d["sentence2"], truncation=True, max_length=max_len)
                self.items.append((enc["input_ids"], enc["token_type_ids"], LABEL_MAP[d["label"]]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    L = max(len(b[0]) for b in batch)
    ids = torch.zeros(len(batch), L, dtype=torch.long)
    tt = torch.zeros(len(batch), L, dtype=torch.long)
    mask = torch.zeros(len(batch), L, dtype=torch.long)
    for i, (a, t, _) in enumerate(batch):
        ids[i, : len(a)] = torch.tensor(a)
        tt[i, : len(t)] = torch.tensor(t)
        mask[i, : len(a)] = 1
    labels = torch.tensor([b[2] for b in batch], dtype=torch.long)
    return ids, tt, mask, labels


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    res = torch.zeros(2, device=device)
    for ids, tt, mask, labels in loader:
        ids, tt, mask, labels = ids.to(device), tt.to(device), mask.to(device), labels.to(device)
        logits = model(input_ids=ids, token_type_ids=tt, attention_mask=mask).logits
        res[0] += (logits.argmax(-1) == labels).sum()
        res[1] += labels.size(0)
    dist.all_reduce(res)
    model.train()
    return (res[0] / res[1]).item()


def save_ckpt(path, model, optimizer, scheduler, epoch, step, best_acc):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "step": step,
        "best_acc": best_acc,
    }, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = BertTokenizerFast.from_pretrained(args.model_dir)
    train_ds = OcnliDataset(os.path.join(args.data_dir, "train.50k.json"), tokenizer, args.max_len)
    dev_ds = OcnliDataset(os.path.join(args.data_dir, "dev.json"), tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, collate_fn=collate,
                            sampler=DistributedSampler(dev_ds, shuffle=False, drop_last=True))

    model = BertForSequenceClassification.from_pretrained(args.model_dir, num_labels=3).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup * total_steps), total_steps)

    start_epoch, global_step, best_acc = 0, 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, global_step, best_acc = ckpt["epoch"], ckpt["step"], ckpt["best_acc"]
        del ckpt
        logger.info("从 %s 恢复: epoch=%d step=%d best_acc=%.4f", args.resume, start_epoch, global_step, best_acc)

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    logger.info("train=%d dev=%d world=%d steps/epoch=%d", len(train_ds), len(dev_ds), world_size, steps_per_epoch)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        done_in_epoch = global_step - epoch * steps_per_epoch
        for i, (ids, tt, mask, labels) in enumerate(train_loader):
            if i < done_in_epoch:
                continue
            ids, tt, mask, labels = ids.to(device), tt.to(device), mask.to(device), labels.to(device)
            loss = model(input_ids=ids, token_type_ids=tt, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, global_step, total_steps, loss.item())
            if global_step % args.save_every == 0:
                if rank == 0:
                    save_ckpt(os.path.join(args.output_dir, "last.pt"), model, optimizer, scheduler,
                              epoch, global_step, best_acc)
                    logger.info("checkpoint 已保存 (step %d)", global_step)
                dist.barrier()

        acc = evaluate(model, dev_loader, device)
        logger.info("epoch %d dev acc %.4f", epoch, acc)
        if rank == 0:
            if acc > best_acc:
                best_acc = acc
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
                logger.info("最优模型更新 acc=%.4f", best_acc)
            save_ckpt(os.path.join(args.output_dir, "last.pt"), model, optimizer, scheduler,
                      epoch + 1, global_step, best_acc)
        dist.barrier()

    logger.info("训练完成, best acc = %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
