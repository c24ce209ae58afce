#!/usr/bin/env python
"""
Task-specific knowledge distillation: a fine-tuned BERT-large teacher -> DistilBERT student on GLUE (SST-2 / MNLI).

    torchrun --nproc_per_node=4 10_kd_distilbert.py --task sst2 --teacher ./ckpt/bert-large-sst2
"""
import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          get_linear_schedule_with_warmup)

TASK_KEYS = {"sst2": ("sentence", None, 2), "mnli": ("premise", "hypothesis", 3), "qnli": ("question", "sentence", 2)}


@dataclass
class KDConfig:
    task: str
    teacher: str
    student: str
    out_dir: str
    batch_size: int
    lr: float
    epochs: int
    temperature: float
    alpha: float
    max_len: int
    log_every: int


def get_config() -> KDConfig:
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="sst2", choices=list(TASK_KEYS))
    p.add_argument("--teacher", required=True)
    p.add_argument("--student", default="distilbert-base-uncased")
    p.add_argument("--out_dir", default="out/distilbert-kd")
    p.add_argument("--batch_size", type=int, default=32, help="per device")
    p.add_argument("--lr", type=float, default=5e-5, help="for a total batch of 128")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the KD term")
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--log_every", type=int, default=50)
    return KDConfig(**vars(p.parse_args()))


def kd_loss(student_logits, teacher_logits, labels, T, alpha):
    soft = F.kl_div(F.log_softmax(student_logits / T, dim=-1), F.softmax(teacher_logits / T, dim=-1),
                    reduction="batchmean") * (T * T)
    hard = F.cross_entropy(student_logits, labels)
    return alpha * soft + (1 - alpha) * hard


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    correct = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        correct[0] += (logits.argmax(-1) == labels).sum()
        correct[1] += labels.numel()
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def main():
    cfg = get_config()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    k1, k2, num_labels = TASK_KEYS[cfg.task]
    tokenizer = AutoTokenizer.from_pretrained(cfg.student)

    def tokenize(ex):
        args = (ex[k1],) if k2 is None else (ex[k1], ex[k2])
        return tokenizer(*args, truncation=True, max_length=cfg.max_len)

    # rank 0 builds the HF datasets cache first, the others then read it
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", cfg.task)
    drop_cols = [c for c in raw["train"].column_names if c != "label"]
    data = raw.map(tokenize, batched=True, remove_columns=drop_cols).rename_column("label", "labels")
    if rank == 0:
        dist.barrier()

    val_split = "validation_matched" if cfg.task == "mnli" else "validation"
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(data["train"], shuffle=True)
    train_loader = DataLoader(data["train"], batch_size=cfg.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, drop_last=True)
    val_part = Subset(data[val_split], list(range(rank, len(data[val_split]), world)))
    val_loader = DataLoader(val_part, batch_size=128, collate_fn=collator)

    teacher = AutoModelForSequenceClassification.from_pretrained(cfg.teacher, num_labels=num_labels)
    teacher.to(device).eval().requires_grad_(False)
    student = AutoModelForSequenceClassification.from_pretrained(cfg.student, num_labels=num_labels)
    student.to(device)
    student = DDP(student, device_ids=[local_rank])

    lr = cfg.lr * cfg.batch_size * world / 128
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in student.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in student.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    total = len(train_loader) * cfg.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)

    t_acc = accuracy(teacher, val_loader, device)
    if rank == 0:
        print(f"teacher val acc {t_acc:.4f}", flush=True)

    best = 0.0
    step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t_logits = teacher(**batch).logits
                s_logits = student(**batch).logits
            loss = kd_loss(s_logits.float(), t_logits.float(), labels, cfg.temperature, cfg.alpha)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"{(time.time() - t0) / cfg.log_every:.3f}s/it", flush=True)
                t0 = time.time()

        acc = accuracy(student.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: student val acc {acc:.4f} (teacher {t_acc:.4f})", flush=True)
            if acc > best:
                best = acc
                student.save_pretrained(cfg.out_dir)
                tokenizer.save_pretrained(cfg.out_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
