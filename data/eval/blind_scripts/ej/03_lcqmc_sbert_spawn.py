# -*- coding: utf-8 -*-
"""
LCQMC 问题匹配 —— Sentence-BERT 双塔（召回用），mp.spawn 单机多卡
训练目标: (u, v, |u-v|) 拼接后做二分类；验证用余弦相似度的 Spearman + 阈值 acc

    python 03_lcqmc_sbert_spawn.py --model /data/pretrained/chinese-macbert-base \
        --train data/lcqmc/train.tsv --dev data/lcqmc/dev.tsv --out ckpt/lcqmc_sbert --gpus 4
"""
import argparse
import csv
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", type=str, default="29531")
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--bs", type=int, default=64, help="每张卡的 batch")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


class PairDataset(Dataset):
    """tsv: text_a \t text_b \t label"""

    def __init__(self, path):
        self.rows = []
        with open(path, encoding="utf-8") as f:
            for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
                if len(row) != 3 or row[2] not in ("0", "1"):
                    continue
                self.rows.append((row[0], row[1], int(row[2])))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class PairCollator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        a, b, y = zip(*batch)
        ea = self.tok(list(a), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        eb = self.tok(list(b), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        return ea, eb, torch.tensor(y, dtype=torch.long)


def mean_pool(last_hidden, mask):
    mask = mask.unsqueeze(-1).float()
    return (last_hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


class SBert(nn.Module):
    def __init__(self, path):
        super().__init__()
        # 只用 mean pooling，不需要 pooler
        self.encoder = AutoModel.from_pretrained(path, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.cls = nn.Linear(3 * h, 2)

    def encode(self, enc):
        out = self.encoder(**enc).last_hidden_state
        return mean_pool(out, enc["attention_mask"])

    def forward(self, ea, eb):
        u, v = self.encode(ea), self.encode(eb)
        return self.cls(torch.cat([u, v, torch.abs(u - v)], dim=-1)), u, v


def to_device(enc, device):
    return {k: t.to(device, non_blocking=True) for k, t in enc.items()}


@torch.no_grad()
def evaluate(model, dev_set, collate, device, rank, world_size):
    """每个 rank 算自己那一份的 cos，再 all_gather_object 汇总到一起算 spearman"""
    model.eval()
    idx = list(range(rank, len(dev_set), world_size))
    sub = [dev_set[i] for i in idx]
    loader = DataLoader(sub, batch_size=128, collate_fn=collate)
    sims, labels = [], []
    for ea, eb, y in loader:
        u = model.encode(to_device(ea, device))
        v = model.encode(to_device(eb, device))
        sims.extend(F.cosine_similarity(u, v).float().cpu().tolist())
        labels.extend(y.tolist())
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (sims, labels))
    all_sims = np.concatenate([np.asarray(g[0]) for g in gathered])
    all_labels = np.concatenate([np.asarray(g[1]) for g in gathered])
    rho = spearmanr(all_sims, all_labels).correlation
    acc = max(((all_sims > t) == all_labels).mean() for t in np.arange(0.5, 0.96, 0.01))
    model.train()
    return rho, acc


def worker(local_rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    device = torch.device(f"cuda:{local_rank}")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    is_main = local_rank == 0
    writer = SummaryWriter(os.path.join(args.out, "tb")) if is_main else None

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collate = PairCollator(tokenizer, args.max_len)
    train_set, dev_set = PairDataset(args.train), PairDataset(args.dev)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=local_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)

    model = SBert(args.model).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.01)
    updates_per_epoch = len(loader) // args.accum
    total = updates_per_epoch * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(0.06 * total), total)

    if is_main:
        print(f"[info] 训练对 {len(train_set)}，验证对 {len(dev_set)}，{world_size} 卡，"
              f"等效 batch {args.bs * args.accum * world_size}，总更新步 {total}")

    best_rho, step = -1.0, 0
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        ddp_model.train()
        for it, (ea, eb, y) in enumerate(loader):
            ea, eb, y = to_device(ea, device), to_device(eb, device), y.to(device)
            sync_now = (it + 1) % args.accum == 0
            if sync_now:
                logits, _, _ = ddp_model(ea, eb)
                loss = F.cross_entropy(logits, y) / args.accum
                loss.backward()
            else:
                # 梯度累积的中间步不做 all-reduce
                with ddp_model.no_sync():
                    logits, _, _ = ddp_model(ea, eb)
                    loss = F.cross_entropy(logits, y) / args.accum
                    loss.backward()
            if not sync_now:
                continue
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if is_main and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item() * args.accum, step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        rho, acc = evaluate(model, dev_set, collate, device, local_rank, world_size)
        if is_main:
            print(f"[epoch {ep}] dev spearman={rho:.4f} best_acc={acc:.4f}")
            writer.add_scalar("dev/spearman", rho, step)
            writer.add_scalar("dev/acc", acc, step)
            if rho > best_rho:
                best_rho = rho
                os.makedirs(args.out, exist_ok=True)
                model.encoder.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
                torch.save(model.cls.state_dict(), os.path.join(args.out, "best", "cls_head.pt"))
        dist.barrier()

    if is_main:
        writer.close()
        print(f"[done] best spearman {best_rho:.4f}")
    dist.destroy_process_group()


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    world_size = args.gpus
    assert world_size <= torch.cuda.device_count(), "gpus 参数超过可见卡数"
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
