"""Search-query intent classifier (navigational / product / support / ... ) fine-tuned from DistilBERT.

Single 4-GPU box, started with plain python; processes are spawned here:
    python 15_query_intent_spawn.py --config configs/intent.yaml
"""
import argparse
import logging
import os
import socket
from dataclasses import dataclass

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

INTENTS = ["navigational", "product_lookup", "category_browse", "price_compare", "order_support",
           "returns", "store_locator", "other"]


@dataclass
class IntentConfig:
    model_name: str = "distilbert-base-multilingual-cased"
    train_csv: str = "data/intent/train.csv"
    valid_csv: str = "data/intent/valid.csv"
    max_len: int = 32
    batch_size: int = 256
    lr: float = 5e-5
    epochs: int = 5
    out_dir: str = "checkpoints/intent"
    master_port: int = 0


class QueryDataset(Dataset):
    def __init__(self, csv_path):
        df = pd.read_csv(csv_path)
        label_idx = {name: i for i, name in enumerate(INTENTS)}
        self.queries = df["query"].astype(str).tolist()
        self.labels = df["intent"].map(label_idx).fillna(label_idx["other"]).astype(int).tolist()

    def __len__(self):
        return len(self.queries)

    def __getitem__(self, i):
        return self.queries[i], self.labels[i]


class TokenizeCollate:
    def __init__(self, model_name, max_len):
        self.tok = AutoTokenizer.from_pretrained(model_name)
        self.max_len = max_len

    def __call__(self, batch):
        q, y = zip(*batch)
        enc = self.tok(list(q), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(y)
        return enc


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        totals[0] += out.loss * batch["labels"].size(0)
        totals[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        totals[2] += batch["labels"].size(0)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def train_worker(rank: int, world_size: int, cfg: IntentConfig):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    log = logging.getLogger("intent")

    collate = TokenizeCollate(cfg.model_name, cfg.max_len)
    train_ds, valid_ds = QueryDataset(cfg.train_csv), QueryDataset(cfg.valid_csv)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=2, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=cfg.batch_size, collate_fn=collate, num_workers=2,
                              sampler=DistributedSampler(valid_ds, num_replicas=world_size, rank=rank, shuffle=False))

    model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, num_labels=len(INTENTS)).to(device)
    model = DDP(model, device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    total = len(train_loader) * cfg.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, total // 10, total)

    best_acc = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 200 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())
        val_loss, val_acc = evaluate(model, valid_loader, device)
        log.info("epoch %d val_loss %.4f val_acc %.4f", epoch, val_loss, val_acc)
        if rank == 0 and val_acc > best_acc:
            best_acc = val_acc
            model.module.save_pretrained(cfg.out_dir)
            collate.tok.save_pretrained(cfg.out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    with open(parser.parse_args().config) as fh:
        config = IntentConfig(**yaml.safe_load(fh))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(config.master_port or free_port()))
    n_gpus = torch.cuda.device_count()
    os.makedirs(config.out_dir, exist_ok=True)
    mp.spawn(train_worker, args=(config, n_gpus), nprocs=n_gpus, join=True)
