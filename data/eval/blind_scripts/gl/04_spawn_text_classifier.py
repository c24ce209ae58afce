"""Multi-GPU fine-tuning of a sequence classifier, started with torch.multiprocessing.spawn.

    python 04_spawn_text_classifier.py --config configs/tickets_roberta.yaml

Example config:
    model_name: distilroberta-base
    train_csv: /data/tickets/train.csv
    val_csv: /data/tickets/val.csv
    output_dir: /mnt/shared/exp/tickets-roberta
    num_labels: 14
    gpus: 4
"""
import argparse
import dataclasses
import logging
import os
import random
import socket
import sys
import time
from typing import Optional

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


@dataclasses.dataclass
class Config:
    model_name: str = "distilroberta-base"
    train_csv: str = ""
    val_csv: str = ""
    output_dir: str = "./out"
    num_labels: int = 2
    gpus: int = 1
    max_len: int = 256
    batch_size: int = 32          # per GPU
    lr: float = 3e-5
    epochs: int = 4
    warmup_ratio: float = 0.06
    weight_decay: float = 0.01
    seed: int = 17
    master_port: Optional[int] = None


class TicketDataset(Dataset):
    def __init__(self, csv_path, tokenizer, max_len):
        df = pd.read_csv(csv_path)
        self.enc = tokenizer(df["text"].astype(str).tolist(), truncation=True, max_length=max_len,
                             padding="max_length", return_tensors="pt")
        self.labels = torch.tensor(df["label"].values, dtype=torch.long)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.enc["input_ids"][i],
                "attention_mask": self.enc["attention_mask"][i],
                "labels": self.labels[i]}


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def setup_logging(rank, out_dir):
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    handlers = [logging.FileHandler(os.path.join(out_dir, "logs", f"rank{rank}.log"))]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
    return logging.getLogger(__name__)


@torch.no_grad()
def evaluate(model, loader, device, num_labels):
    model.eval()
    confusion = torch.zeros(num_labels, num_labels, device=device, dtype=torch.long)
    loss_sum = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        loss_sum[0] += out.loss * batch["labels"].numel()
        loss_sum[1] += batch["labels"].numel()
        pred = out.logits.argmax(-1)
        idx = batch["labels"] * num_labels + pred
        confusion += torch.bincount(idx, minlength=num_labels ** 2).view(num_labels, num_labels)
    dist.all_reduce(confusion)
    dist.all_reduce(loss_sum)
    model.train()
    tp = confusion.diag().float()
    prec = tp / confusion.sum(0).clamp(min=1)
    rec = tp / confusion.sum(1).clamp(min=1)
    f1 = (2 * prec * rec / (prec + rec).clamp(min=1e-8)).mean().item()
    acc = (tp.sum() / confusion.sum()).item()
    return (loss_sum[0] / loss_sum[1]).item(), acc, f1


def run(local_rank: int, world_size: int, cfg: Config):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    log = setup_logging(local_rank, cfg.output_dir)
    seed_everything(cfg.seed)

    tok = AutoTokenizer.from_pretrained(cfg.model_name)
    train_ds = TicketDataset(cfg.train_csv, tok, cfg.max_len)
    val_ds = TicketDataset(cfg.val_csv, tok, cfg.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                          num_workers=2, pin_memory=True, drop_last=True)
    # no padding for eval: every rank takes a strided slice
    val_idx = list(range(local_rank, len(val_ds), world_size))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=cfg.batch_size * 2,
                        num_workers=2, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, num_labels=cfg.num_labels)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    # linear scaling from the single-GPU recipe
    opt = torch.optim.AdamW(groups, lr=cfg.lr * world_size)
    total_steps = cfg.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(cfg.warmup_ratio * total_steps), total_steps)

    best_f1 = -1.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % 50 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        val_loss, acc, f1 = evaluate(model, val_dl, device, cfg.num_labels)
        log.info("epoch %d done in %.0fs: val_loss %.4f acc %.4f macro-F1 %.4f",
                 epoch, time.time() - t0, val_loss, acc, f1)
        if local_rank == 0 and f1 > best_f1:
            best_f1 = f1
            save_dir = os.path.join(cfg.output_dir, "best")
            model.module.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
            log.info("saved new best model (F1 %.4f) to %s", f1, save_dir)
        dist.barrier()

    dist.destroy_process_group()


def pick_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, default=None, help="override the config")
    cli = parser.parse_args()

    with open(cli.config) as f:
        cfg = Config(**yaml.safe_load(f))
    if cli.gpus is not None:
        cfg.gpus = cli.gpus
    world_size = min(cfg.gpus, torch.cuda.device_count())
    if world_size < cfg.gpus:
        print(f"only {world_size} GPUs visible, config asks for {cfg.gpus}", file=sys.stderr)

    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(dataclasses.asdict(cfg), f)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(cfg.master_port or pick_port())
    mp.spawn(run, args=(cfg, world_size), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
