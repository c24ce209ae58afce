#!/usr/bin/env python
# Fine-tune a BERT-style encoder for document classification on Slurm.
#
#   #!/bin/bash
#   #SBATCH --nodes=2
#   #SBATCH --ntasks-per-node=4
#   #SBATCH --gpus-per-node=4
#   #SBATCH --cpus-per-task=12
#   #SBATCH --time=08:00:00
#   srun --cpu-bind=cores python bert_cls.py --train data/train.jsonl --dev data/dev.jsonl \
#        --labels data/labels.txt --out /scratch/shared/$USER/bert_cls
#
# srun starts one task per GPU; the rank layout is taken from the Slurm
# variables, so no torchrun is involved.

import argparse
import json
import logging
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("bert_cls")


def setup_slurm_env():
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
    os.environ.setdefault("MASTER_ADDR", socket.gethostname())
    os.environ.setdefault("MASTER_PORT", str(12000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


class JsonlDocs(Dataset):
    def __init__(self, path, label2id, tokenizer, max_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                self.rows.append((ex["text"], label2id[ex["label"]]))
        self.tok, self.max_len = tokenizer, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def collate(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), truncation=True, max_length=self.max_len, padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc


@torch.no_grad()
def evaluate(model, loader, device, num_labels):
    model.eval()
    # confusion matrix so macro-F1 can be computed after the all-reduce
    cm = torch.zeros(num_labels, num_labels, device=device, dtype=torch.long)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits
        idx = batch["labels"] * num_labels + logits.argmax(-1)
        cm += torch.bincount(idx, minlength=num_labels * num_labels).view(num_labels, num_labels)
    dist.all_reduce(cm)
    tp = cm.diag().float()
    prec = tp / cm.sum(0).clamp(min=1)
    rec = tp / cm.sum(1).clamp(min=1)
    f1 = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
    acc = tp.sum() / cm.sum()
    model.train()
    return acc.item(), f1.mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/deberta-v3-base")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--global-batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=0.06)
    args = ap.parse_args()

    rank, world_size, local_rank = setup_slurm_env()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method="env://")
    log.info("world_size=%d master=%s:%s", world_size, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])

    with open(args.labels) as f:
        labels = [l.strip() for l in f if l.strip()]
    label2id = {l: i for i, l in enumerate(labels)}

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = JsonlDocs(args.train, label2id, tok, args.max_len)
    dev_ds = JsonlDocs(args.dev, label2id, tok, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    dev_sub = torch.utils.data.Subset(dev_ds, list(range(rank, len(dev_ds), world_size)))
    per_gpu = args.global_batch_size // world_size
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler,
                          collate_fn=train_ds.collate, num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev_sub, batch_size=64, collate_fn=dev_ds.collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=label2id)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight", "layernorm", "norm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup * total), total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_f1 = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        acc, f1 = evaluate(model.module, dev_dl, device, len(labels))
        log.info("epoch %d dev acc %.4f macro-F1 %.4f (%.0fs)", epoch, acc, f1, time.time() - t0)
        if rank == 0 and f1 > best_f1:
            best_f1 = f1
            model.module.save_pretrained(os.path.join(args.out, "best"))
            tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
