#!/usr/bin/env python
"""Support-ticket topic classifier (fine-tunes a RoBERTa-style encoder).

Runs on a single GPU or under torchrun. The Trainer / callbacks are the shared
ones from the delivery toolkit, vendored here so the job is self-contained on
the client cluster image.
"""
import argparse
import json
import logging
import math
import os
import random
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("ticket-router")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_file", required=True)
    p.add_argument("--val_file", required=True)
    p.add_argument("--label_map", required=True, help="json file: label name -> id")
    p.add_argument("--model_name", default="distilroberta-base")
    p.add_argument("--max_length", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--warmup_ratio", type=float, default=0.06)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--clip_grad", type=float, default=1.0)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--output_dir", default="outputs/ticket-router")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


# --------------------------------------------------------------------------- data
class TicketDataset(Dataset):
    def __init__(self, path, label2id):
        df = pd.read_csv(path)
        df = df[df["label"].isin(label2id)]
        self.texts = (df["subject"].fillna("") + " \n " + df["body"].fillna("")).tolist()
        self.labels = [label2id[x] for x in df["label"]]

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i]


class Collator:
    def __init__(self, tokenizer, max_length):
        self.tok = tokenizer
        self.max_length = max_length

    def __call__(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), padding=True, truncation=True,
                       max_length=self.max_length, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc


class ShardSampler(Sampler):
    """Splits an eval set across ranks without padding / duplicates."""

    def __init__(self, n, rank, world_size):
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


# --------------------------------------------------------------------------- metrics
class MetricAccumulator:
    def __init__(self):
        self.reset()

    def reset(self):
        self.loss_sum = 0.0
        self.correct = 0
        self.n = 0

    def update(self, loss, logits, labels):
        bs = labels.size(0)
        self.loss_sum += loss.item() * bs
        self.correct += (logits.argmax(-1) == labels).sum().item()
        self.n += bs

    def compute(self, prefix):
        return {f"{prefix}_loss": self.loss_sum / max(self.n, 1),
                f"{prefix}_acc": self.correct / max(self.n, 1)}


# --------------------------------------------------------------------------- callbacks
class Callback:
    def on_fit_start(self, trainer): ...
    def on_batch_end(self, trainer, logs): ...
    def on_epoch_end(self, trainer, logs): ...
    def on_fit_end(self, trainer): ...


class ModelCheckpoint(Callback):
    def __init__(self, dirpath, monitor="val_acc", mode="max"):
        self.dirpath = Path(dirpath)
        self.monitor, self.mode = monitor, mode
        self.best = -math.inf if mode == "max" else math.inf

    def on_epoch_end(self, trainer, logs):
        if not trainer.is_main:
            return
        self.dirpath.mkdir(parents=True, exist_ok=True)
        trainer.save(self.dirpath / "last.pt")
        value = logs[self.monitor]
        better = value > self.best if self.mode == "max" else value < self.best
        if better:
            self.best = value
            trainer.save(self.dirpath / "best.pt")
            log.info("new best %s=%.4f at epoch %d", self.monitor, value, trainer.epoch)


class LRMonitor(Callback):
    def __init__(self, every=50):
        self.every = every

    def on_batch_end(self, trainer, logs):
        if trainer.is_main and trainer.global_step % self.every == 0:
            logs["lr"] = trainer.scheduler.get_last_lr()[0]


class ProgressBar(Callback):
    def on_fit_start(self, trainer):
        self.bar = None

    def on_batch_end(self, trainer, logs):
        if not trainer.is_main:
            return
        if self.bar is None or self.bar.n >= self.bar.total:
            self.bar = tqdm(total=len(trainer.train_loader), desc=f"epoch {trainer.epoch}", leave=False)
        self.bar.update(1)
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items()})

    def on_epoch_end(self, trainer, logs):
        if trainer.is_main:
            log.info("epoch %d | %s", trainer.epoch, json.dumps({k: round(v, 5) for k, v in logs.items()}))


# --------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, train_loader, val_loader, *, device,
                 callbacks=(), epochs=1, grad_accum=1, clip_grad=None):
        self.device = device
        self.model = model.to(device)
        if dist.is_initialized():
            self.model = DDP(self.model, device_ids=[device.index])
        self.optimizer, self.scheduler = optimizer, scheduler
        self.train_loader, self.val_loader = train_loader, val_loader
        self.callbacks = list(callbacks)
        self.epochs, self.grad_accum, self.clip_grad = epochs, grad_accum, clip_grad
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.global_step, self.epoch = 0, 0

    @property
    def unwrapped(self):
        return self.model.module if isinstance(self.model, DDP) else self.model

    def _hook(self, name, *args):
        for cb in self.callbacks:
            getattr(cb, name)(self, *args)

    def save(self, path):
        torch.save({"model": self.unwrapped.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "epoch": self.epoch, "global_step": self.global_step}, path)

    def fit(self):
        self._hook("on_fit_start")
        for epoch in range(self.epochs):
            self.epoch = epoch
            self.train_loader.sampler.set_epoch(epoch)
            logs = self.train_one_epoch()
            logs.update(self.evaluate())
            self._hook("on_epoch_end", logs)
        self._hook("on_fit_end")

    def train_one_epoch(self):
        self.model.train()
        meter = MetricAccumulator()
        n_batches = len(self.train_loader)
        for i, batch in enumerate(self.train_loader):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % self.grad_accum == 0 or (i + 1) == n_batches
            sync_ctx = nullcontext() if (last_micro or not isinstance(self.model, DDP)) else self.model.no_sync()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = self.model(**batch)
                    loss = out.loss / self.grad_accum
                loss.backward()
            meter.update(out.loss.float(), out.logits.float(), batch["labels"])
            if last_micro:
                if self.clip_grad:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.global_step += 1
            self._hook("on_batch_end", {"loss": out.loss.item()})
        return meter.compute("train")

    @torch.no_grad()
    def evaluate(self):
        model = self.unwrapped
        model.eval()
        meter = MetricAccumulator()
        for batch in self.val_loader:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**batch)
            meter.update(out.loss.float(), out.logits.float(), batch["labels"])
        return meter.compute("val")


# --------------------------------------------------------------------------- main
def main():
    args = parse_args()
    distributed = "LOCAL_RANK" in os.environ
    if distributed:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        local_rank, rank, world_size = 0, 0, 1
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    label2id = json.loads(Path(args.label_map).read_text())
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    collate = Collator(tokenizer, args.max_length)

    train_ds = TicketDataset(args.train_file, label2id)
    val_ds = TicketDataset(args.val_file, label2id)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2,
                            sampler=ShardSampler(len(val_ds), rank, world_size),
                            num_workers=args.num_workers, collate_fn=collate, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=len(label2id),
        id2label={v: k for k, v in label2id.items()}, label2id=label2id)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    callbacks = [ProgressBar(), LRMonitor(every=50), ModelCheckpoint(args.output_dir, monitor="val_acc", mode="max")]
    trainer = Trainer(model, optimizer, scheduler, train_loader, val_loader, device=device,
                      callbacks=callbacks, epochs=args.epochs, grad_accum=args.grad_accum,
                      clip_grad=args.clip_grad)
    trainer.fit()

    if rank == 0:
        tokenizer.save_pretrained(args.output_dir)
        log.info("done; best val_acc=%.4f", callbacks[-1].best)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
