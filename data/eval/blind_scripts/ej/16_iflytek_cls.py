# -*- coding: utf-8 -*-
"""
IFLYTEK 长文本 App 描述分类（119 类）
chinese-macbert-base + 分层学习率衰减(LLRD) + EMA

    torchrun --nproc_per_node=4 16_iflytek_cls.py --model_dir /data/pretrained/chinese-macbert-base \
        --data_dir /data/clue/iflytek --output_dir exp/iflytek_macbert
"""
import argparse
import copy
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)
NUM_LABELS = 119


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=4e-5)
    parser.add_argument("--layer_decay", type=float, default=0.9)
    parser.add_argument("--ema_decay", type=float, default=0.999)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=100)
    return parser.parse_args()


class IflytekDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.samples = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                self.samples.append((d["sentence"], int(d["label"])))
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]

    def collate(self, batch):
        texts, labels = zip(*batch)
        enc = self.tokenizer(list(texts), max_length=self.max_len, truncation=True,
                             padding="longest", return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc


class EMA:
    def __init__(self, model, decay):
        self.decay = decay
        self.shadow = copy.deepcopy(model).eval()
        for p in self.shadow.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for s, p in zip(self.shadow.parameters(), model.parameters()):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)


def llrd_param_groups(model, lr, layer_decay, weight_decay=0.01):
    """分层学习率：越靠近输入的层 lr 越小"""
    num_layers = model.config.num_hidden_layers
    groups = []
    for name, p in model.named_parameters():
        if "embeddings" in name:
            depth = 0
        elif "encoder.layer." in name:
            depth = int(name.split("encoder.layer.")[1].split(".")[0]) + 1
        else:
            depth = num_layers + 1
        scale = layer_decay ** (num_layers + 1 - depth)
        wd = 0.0 if ("bias" in name or "LayerNorm" in name) else weight_decay
        groups.append({"params": [p], "lr": lr * scale, "weight_decay": wd})
    return groups


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits
        correct += (logits.argmax(-1) == batch["labels"]).sum().item()
        total += batch["labels"].size(0)
    stats = torch.tensor([correct, total], dtype=torch.long)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return stats[0].item() / stats[1].item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(levelname)s - %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    train_ds = IflytekDataset(os.path.join(args.data_dir, "train.json"), tokenizer, args.max_len)
    dev_ds = IflytekDataset(os.path.join(args.data_dir, "dev.json"), tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=train_ds.collate, num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, collate_fn=dev_ds.collate,
                            sampler=DistributedSampler(dev_ds, shuffle=False, drop_last=True))

    model = AutoModelForSequenceClassification.from_pretrained(args.model_dir, num_labels=NUM_LABELS).to(device)
    optimizer = torch.optim.AdamW(llrd_param_groups(model, args.lr, args.layer_decay))
    ema = EMA(model, args.ema_decay)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)
    logger.info("train %d dev %d | %d GPUs | steps %d", len(train_ds), len(dev_ds), world_size, total_steps)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model.module)
            step += 1
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        acc = evaluate(model.module, dev_loader, device)
        ema_acc = evaluate(ema.shadow, dev_loader, device)
        model.train()
        logger.info("epoch %d | dev acc %.4f | ema acc %.4f", epoch, acc, ema_acc)
        if rank == 0 and max(acc, ema_acc) > best:
            best = max(acc, ema_acc)
            src = ema.shadow if ema_acc >= acc else model.module
            src.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            logger.info("保存%s模型，acc %.4f", "EMA " if src is ema.shadow else "", best)
        dist.barrier()

    logger.info("best dev acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
