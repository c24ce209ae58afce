# -*- coding: utf-8 -*-
"""
搜索召回双塔模型（query 塔 / doc 塔），batch 内负采样 + 跨卡负样本

训练数据：点击日志抽取的 (query, clicked_title) 对
评估：在验证集上计算 Recall@K（以同 batch 的 doc 作为候选库）

启动：
    torchrun --nproc_per_node=8 --master_port=29512 04_dual_tower_retrieval.py \
        --train_file /mnt/hdfs-fuse/search/recall/train.tsv \
        --dev_file /mnt/hdfs-fuse/search/recall/dev.tsv \
        --output_dir /mnt/hdfs-fuse/search/recall/ckpt/dt_v7
"""
import os
import math
import time
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, AutoModel
from loguru import logger


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", default="/mnt/nas/models/chinese-roberta-wwm-ext")
    p.add_argument("--train_file", required=True)
    p.add_argument("--dev_file", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_q_len", type=int, default=32)
    p.add_argument("--max_d_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--emb_dim", type=int, default=128)
    p.add_argument("--eval_steps", type=int, default=2000)
    return p.parse_args()


class PairDataset(Dataset):
    def __init__(self, path):
        self.pairs = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                cols = line.rstrip("\n").split("\t")
                if len(cols) >= 2:
                    self.pairs.append((cols[0], cols[1]))

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


class Collator(object):
    def __init__(self, tokenizer, max_q_len, max_d_len):
        self.tok = tokenizer
        self.max_q_len = max_q_len
        self.max_d_len = max_d_len

    def __call__(self, batch):
        qs, ds = zip(*batch)
        q = self.tok(list(qs), max_length=self.max_q_len, truncation=True, padding=True, return_tensors="pt")
        d = self.tok(list(ds), max_length=self.max_d_len, truncation=True, padding=True, return_tensors="pt")
        return q, d


class DualTower(nn.Module):
    """query / doc 共享底座，分别接投影层"""

    def __init__(self, pretrained, emb_dim):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(pretrained)
        hidden = self.encoder.config.hidden_size
        self.q_proj = nn.Linear(hidden, emb_dim)
        self.d_proj = nn.Linear(hidden, emb_dim)

    def _pool(self, inputs):
        out = self.encoder(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        return (out * mask).sum(1) / mask.sum(1).clamp(min=1e-6)

    def encode_query(self, q):
        return F.normalize(self.q_proj(self._pool(q)), dim=-1)

    def encode_doc(self, d):
        return F.normalize(self.d_proj(self._pool(d)), dim=-1)

    def forward(self, q, d):
        return self.encode_query(q), self.encode_doc(d)


class GatherLayer(torch.autograd.Function):
    """all_gather 并保留梯度，用于跨卡负样本"""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def contrastive_loss(q_emb, d_emb, temperature):
    all_d = torch.cat(GatherLayer.apply(d_emb), dim=0)
    logits = q_emb @ all_d.t() / temperature
    offset = dist.get_rank() * q_emb.size(0)
    labels = torch.arange(q_emb.size(0), device=q_emb.device) + offset
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def evaluate(model, dev_loader, device, ks=(1, 10, 50)):
    """各卡在自己的 dev 分片内做 batch 内检索，统计命中后 all_reduce"""
    model.eval()
    hits = torch.zeros(len(ks), device=device)
    total = torch.zeros(1, device=device)
    for q, d in dev_loader:
        q = {k: v.to(device) for k, v in q.items()}
        d = {k: v.to(device) for k, v in d.items()}
        q_emb = model.encode_query(q)
        d_emb = model.encode_doc(d)
        scores = q_emb @ d_emb.t()
        gold = torch.arange(scores.size(0), device=device)
        rank_of_gold = (scores > scores.gather(1, gold.unsqueeze(1))).sum(1)
        for i, k in enumerate(ks):
            hits[i] += (rank_of_gold < k).sum()
        total += scores.size(0)
    dist.all_reduce(hits)
    dist.all_reduce(total)
    model.train()
    return {"recall@%d" % k: (hits[i] / total).item() for i, k in enumerate(ks)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.remove()

    tokenizer = AutoTokenizer.from_pretrained(args.pretrained)
    collator = Collator(tokenizer, args.max_q_len, args.max_d_len)
    train_set = PairDataset(args.train_file)
    dev_set = PairDataset(args.dev_file)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    dev_sampler = DistributedSampler(dev_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=args.batch_size, sampler=dev_sampler,
                            collate_fn=collator, num_workers=2, drop_last=True)
    logger.info("train pairs {}, dev pairs {}, world_size {}", len(train_set), len(dev_set), world)

    model = DualTower(args.pretrained, args.emb_dim).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    warmup = int(0.05 * total_steps)
    lr_lambda = lambda s: s / max(1, warmup) if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total_steps - warmup)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    step, best_r10 = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for q, d in train_loader:
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            d = {k: v.to(device, non_blocking=True) for k, v in d.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q_emb, d_emb = model(q, d)
            loss = contrastive_loss(q_emb.float(), d_emb.float(), args.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1

            if step % 100 == 0:
                logger.info("epoch {} step {} loss {:.4f} lr {:.2e} ({:.1f}s)", epoch, step, loss.item(),
                            scheduler.get_last_lr()[0], time.time() - tic)
                tic = time.time()

            if step % args.eval_steps == 0:
                metrics = evaluate(model, dev_loader, device)
                logger.info("step {} 验证: {}", step, metrics)
                if rank == 0 and metrics["recall@10"] > best_r10:
                    best_r10 = metrics["recall@10"]
                    torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.bin"))
                    logger.info("保存最优模型 recall@10={:.4f}", best_r10)

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch},
                       os.path.join(args.output_dir, "epoch{}.ckpt".format(epoch)))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
