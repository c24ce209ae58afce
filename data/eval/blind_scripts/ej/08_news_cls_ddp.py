# -*- coding: utf-8 -*-
"""
资讯流多分类（内部 28 类频道标签），chinese-bert-wwm-ext
支持断点续训、特征缓存、梯度累积、fp16

    torchrun --nproc_per_node=8 08_news_cls_ddp.py --model_dir /mnt/pretrain/chinese-bert-wwm-ext \
        --data_dir /mnt/data/feed_cls --output_dir /mnt/exp/feed_cls_v2 --grad_accum 2
"""
import argparse
import glob
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import BertForSequenceClassification, BertTokenizerFast, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup_ratio", type=float, default=0.05)
    parser.add_argument("--save_steps", type=int, default=2000)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    # 兼容老的 torch.distributed.launch，torchrun 下以环境变量为准
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        args.local_rank = int(os.environ["LOCAL_RANK"])
    return args


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_tsv(path):
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            if len(cols) < 3:
                continue
            title, content, label = cols[0], cols[1], cols[2]
            texts.append((title, content[:200]))
            labels.append(label)
    return texts, labels


def load_and_cache(args, tokenizer, split, label2id, rank):
    # 只让 rank0 做分词和写缓存，其它进程等它写完后直接读
    if rank != 0:
        dist.barrier()

    cache_path = os.path.join(args.data_dir, f"cached_{split}_{args.max_len}.pt")
    if os.path.exists(cache_path):
        logger.info("加载缓存 %s", cache_path)
        tensors = torch.load(cache_path)
    else:
        logger.info("构建特征 %s", split)
        texts, labels = read_tsv(os.path.join(args.data_dir, f"{split}.tsv"))
        enc = tokenizer([t for t, _ in texts], [c for _, c in texts], max_length=args.max_len,
                        truncation="only_second", padding="max_length", return_tensors="pt")
        tensors = {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "token_type_ids": enc["token_type_ids"],
            "labels": torch.tensor([label2id[x] for x in labels], dtype=torch.long),
        }
        tmp = cache_path + ".tmp"
        torch.save(tensors, tmp)
        os.replace(tmp, cache_path)

    if rank == 0:
        dist.barrier()
    return TensorDataset(tensors["input_ids"], tensors["attention_mask"],
                         tensors["token_type_ids"], tensors["labels"])


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stat = torch.zeros(2, dtype=torch.float64, device=device)
    for input_ids, attn, tti, labels in loader:
        logits = model(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                       token_type_ids=tti.to(device)).logits
        stat[0] += (logits.argmax(-1).cpu() == labels).sum().item()
        stat[1] += labels.size(0)
    dist.all_reduce(stat)
    model.train()
    return (stat[0] / stat[1]).item()


def save_checkpoint(args, model, optimizer, scheduler, scaler, step, epoch):
    ckpt_dir = os.path.join(args.output_dir, f"checkpoint-{step}")
    os.makedirs(ckpt_dir, exist_ok=True)
    model.module.save_pretrained(ckpt_dir)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "step": step, "epoch": epoch},
               os.path.join(ckpt_dir, "training_state.pt"))
    logger.info("checkpoint 保存到 %s", ckpt_dir)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    set_seed(args.seed)

    with open(os.path.join(args.data_dir, "labels.txt"), encoding="utf-8") as f:
        label_list = [x.strip() for x in f if x.strip()]
    label2id = {x: i for i, x in enumerate(label_list)}

    tokenizer = BertTokenizerFast.from_pretrained(args.model_dir)
    train_ds = load_and_cache(args, tokenizer, "train", label2id, rank)
    dev_ds = load_and_cache(args, tokenizer, "dev", label2id, rank)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=128, sampler=dev_sampler)

    # 续训：找最新的 checkpoint
    ckpts = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[-1]))
    resume_dir = ckpts[-1] if ckpts else None
    model = BertForSequenceClassification.from_pretrained(resume_dir or args.model_dir, num_labels=len(label_list))
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates_per_epoch = len(train_loader) // args.grad_accum
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    start_epoch, global_step = 0, 0
    if resume_dir:
        state = torch.load(os.path.join(resume_dir, "training_state.pt"), map_location="cpu")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        global_step, start_epoch = state["step"], state["epoch"]
        logger.info("从 %s 恢复，step=%d epoch=%d", resume_dir, global_step, start_epoch)

    writer = SummaryWriter(os.path.join(args.output_dir, "runs")) if rank == 0 else None
    logger.info("train=%d dev=%d world=%d total_updates=%d", len(train_ds), len(dev_ds), world_size, total_updates)

    skip_updates = global_step - start_epoch * updates_per_epoch
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (input_ids, attn, tti, labels) in enumerate(train_loader):
            if epoch == start_epoch and i < skip_updates * args.grad_accum:
                continue  # 续训时跳过本 epoch 已经训练过的 batch（所有 rank 跳过的数量一致）
            input_ids, attn, tti, labels = (t.to(device, non_blocking=True) for t in (input_ids, attn, tti, labels))
            is_update = (i + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not is_update else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                    loss = model(input_ids=input_ids, attention_mask=attn, token_type_ids=tti, labels=labels).loss
                scaler.scale(loss / args.grad_accum).backward()
            if not is_update:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if rank == 0 and global_step % 50 == 0:
                writer.add_scalar("loss", loss.item(), global_step)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], global_step)
            if global_step % args.save_steps == 0:
                if rank == 0:
                    save_checkpoint(args, model, optimizer, scheduler, scaler, global_step, epoch)
                dist.barrier()

        acc = evaluate(model, dev_loader, device)
        if rank == 0:
            logger.info("epoch %d dev acc %.4f", epoch, acc)
            writer.add_scalar("dev_acc", acc, global_step)
            save_checkpoint(args, model, optimizer, scheduler, scaler, global_step, epoch + 1)
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
