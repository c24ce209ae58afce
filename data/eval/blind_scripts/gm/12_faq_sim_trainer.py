# -*- coding: utf-8 -*-
"""
FAQ 问答匹配：句对相似度二分类（cross-encoder）

内部 Trainer 的精简版，按照 trainer/base_trainer.py 的结构拆成 build_* / train_one_epoch / validate。
启动：
    torchrun --nproc_per_node=8 12_faq_sim_trainer.py --data_dir /mnt/nas/faq/lcqmc_plus --exp faq_ernie_v2
"""
import os
import csv
import time
import argparse
import logging
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoTokenizer, AutoModel, get_linear_schedule_with_warmup


@dataclass
class TrainConfig:
    data_dir: str = ""
    exp: str = "faq_match"
    pretrained: str = "/mnt/nas/models/ernie-3.0-base-zh"
    output_root: str = "/mnt/nas/faq/experiments"
    max_len: int = 96
    batch_size: int = 64
    epochs: int = 4
    lr: float = 2e-5
    warmup: float = 0.1
    dropout: float = 0.1
    seed: int = 42
    log_steps: int = 100


def parse_config():
    parser = argparse.ArgumentParser()
    for k, v in asdict(TrainConfig()).items():
        parser.add_argument("--" + k, type=type(v), default=v)
    return TrainConfig(**vars(parser.parse_args()))


class PairDataset(Dataset):
    """tsv: sent_a \t sent_b \t label"""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            self.rows = [(r[0], r[1], int(r[2])) for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
                         if len(r) == 3]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class CrossEncoder(nn.Module):
    def __init__(self, pretrained, dropout):
        super().__init__()
        self.bert = AutoModel.from_pretrained(pretrained)
        self.dropout = nn.Dropout(dropout)
        self.cls = nn.Linear(self.bert.config.hidden_size, 2)

    def forward(self, input_ids, attention_mask, token_type_ids):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        return self.cls(self.dropout(h[:, 0]))


class FAQTrainer(object):
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_master = self.rank == 0
        self.out_dir = os.path.join(cfg.output_root, cfg.exp)

        logging.basicConfig(level=logging.INFO if self.is_master else logging.WARNING,
                            format="%(asctime)s [%(levelname)s] %(message)s")
        self.logger = logging.getLogger("faq")
        torch.manual_seed(cfg.seed)

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.pretrained)
        self.build_data()
        self.build_model()
        self.writer = SummaryWriter(os.path.join(self.out_dir, "tb")) if self.is_master else None
        if self.is_master:
            self.logger.info("配置: %s", asdict(cfg))

    def collate(self, batch):
        a, b, y = zip(*batch)
        enc = self.tokenizer(list(a), list(b), max_length=self.cfg.max_len, truncation=True,
                             padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], torch.tensor(y)

    def build_data(self):
        cfg = self.cfg
        self.train_set = PairDataset(os.path.join(cfg.data_dir, "train.tsv"))
        self.dev_set = PairDataset(os.path.join(cfg.data_dir, "dev.tsv"))
        self.train_sampler = DistributedSampler(self.train_set, num_replicas=self.world_size, rank=self.rank,
                                                shuffle=True, seed=cfg.seed)
        self.train_loader = DataLoader(self.train_set, batch_size=cfg.batch_size, sampler=self.train_sampler,
                                       collate_fn=self.collate, num_workers=4, pin_memory=True, drop_last=True)
        dev_shard = Subset(self.dev_set, range(self.rank, len(self.dev_set), self.world_size))
        self.dev_loader = DataLoader(dev_shard, batch_size=cfg.batch_size * 2, collate_fn=self.collate, num_workers=2)

    def build_model(self):
        cfg = self.cfg
        model = CrossEncoder(cfg.pretrained, cfg.dropout).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank], output_device=self.local_rank)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01)
        total = len(self.train_loader) * cfg.epochs
        self.scheduler = get_linear_schedule_with_warmup(self.optimizer, int(total * cfg.warmup), total)
        self.criterion = nn.CrossEntropyLoss()
        self.global_step = 0

    def train_one_epoch(self, epoch):
        self.model.train()
        t0 = time.time()
        for input_ids, mask, tt, y in self.train_loader:
            input_ids, mask, tt, y = [t.to(self.device, non_blocking=True) for t in (input_ids, mask, tt, y)]
            logits = self.model(input_ids, mask, tt)
            loss = self.criterion(logits, y)
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.global_step += 1
            if self.global_step % self.cfg.log_steps == 0 and self.is_master:
                self.logger.info("epoch %d step %d loss %.4f lr %.2e (%.1fs)", epoch, self.global_step,
                                 loss.item(), self.scheduler.get_last_lr()[0], time.time() - t0)
                self.writer.add_scalar("train/loss", loss.item(), self.global_step)
                self.writer.add_scalar("train/lr", self.scheduler.get_last_lr()[0], self.global_step)
                t0 = time.time()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        # tp, fp, fn, correct, total
        stat = torch.zeros(5, device=self.device)
        for input_ids, mask, tt, y in self.dev_loader:
            input_ids, mask, tt, y = [t.to(self.device) for t in (input_ids, mask, tt, y)]
            pred = self.model.module(input_ids, mask, tt).argmax(-1)
            stat[0] += ((pred == 1) & (y == 1)).sum()
            stat[1] += ((pred == 1) & (y == 0)).sum()
            stat[2] += ((pred == 0) & (y == 1)).sum()
            stat[3] += (pred == y).sum()
            stat[4] += y.numel()
        dist.all_reduce(stat)
        self.model.train()
        tp, fp, fn, correct, total = stat.tolist()
        p, r = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
        return {"acc": correct / max(total, 1), "precision": p, "recall": r, "f1": 2 * p * r / max(p + r, 1e-9)}

    def save(self, name):
        if not self.is_master:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(self.model.module.state_dict(), os.path.join(self.out_dir, name))
        self.tokenizer.save_pretrained(self.out_dir)

    def fit(self):
        best = 0.0
        for epoch in range(self.cfg.epochs):
            self.train_one_epoch(epoch)
            metrics = self.validate()
            self.logger.info("epoch %d 验证集 %s", epoch, {k: round(v, 4) for k, v in metrics.items()})
            if self.is_master:
                for k, v in metrics.items():
                    self.writer.add_scalar("dev/" + k, v, epoch)
            if metrics["f1"] > best:
                best = metrics["f1"]
                self.save("best_model.pt")
            self.save("last_model.pt")
            dist.barrier()
        if self.writer:
            self.writer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    FAQTrainer(parse_config()).fit()
