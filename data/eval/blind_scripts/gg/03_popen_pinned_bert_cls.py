#!/usr/bin/env python3
"""Fine-tune a BERT-style encoder for text classification on a CSV dataset.

One file, two roles:
  * launcher (default): starts one worker process per GPU listed in --gpus,
    pins each worker to its GPU, writes worker_<rank>.log files and restarts the
    whole group on failure;
  * worker (--role worker): the DDP training loop.

    python 03_popen_pinned_bert_cls.py --gpus 0,1,2,3 --train data/train.csv --val data/val.csv
"""
import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["launcher", "worker"], default="launcher")
    p.add_argument("--gpus", default="0,1,2,3")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--train", default="data/train.csv")
    p.add_argument("--val", default="data/val.csv")
    p.add_argument("--labels", default="data/labels.json", help="label name -> id mapping")
    p.add_argument("--out", default="runs/bert_cls")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class CsvTextDataset(Dataset):
    def __init__(self, path, tokenizer, label2id, max_len):
        df = pd.read_csv(path)
        self.texts = df["text"].astype(str).tolist()
        self.labels = [label2id[l] for l in df["label"]]
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tokenizer(self.texts[i], truncation=True, max_length=self.max_len)
        enc["labels"] = self.labels[i]
        return enc


def pad_collate(batch, tokenizer):
    labels = torch.tensor([b.pop("labels") for b in batch])
    out = tokenizer.pad(batch, return_tensors="pt")
    out["labels"] = labels
    return out


# ---------------------------------------------------------------------------- worker
@torch.no_grad()
def evaluate(model, loader, device, num_labels):
    model.eval()
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    loss_sum = torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        loss_sum += out.loss * batch["labels"].size(0)
        correct += (out.logits.argmax(-1) == batch["labels"]).sum()
        seen += batch["labels"].size(0)
    for t in (correct, seen, loss_sum):
        dist.all_reduce(t)
    model.train()
    return (loss_sum / seen).item(), (correct / seen).item()


def run_worker(args):
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)

    with open(args.labels) as f:
        label2id = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = CsvTextDataset(args.train, tokenizer, label2id, args.max_len)
    val_ds = CsvTextDataset(args.val, tokenizer, label2id, args.max_len)
    collate = functools.partial(pad_collate, tokenizer=tokenizer)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world_size))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=64,
                            collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=len(label2id)).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr * world_size ** 0.5)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        val_loss, val_acc = evaluate(model.module, val_loader, device, len(label2id))
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.4f}", flush=True)
            if val_acc > best:
                best = val_acc
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


# ---------------------------------------------------------------------------- launcher
def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_group(gpus, port, log_dir, attempt):
    procs = []
    for local_rank, gpu in enumerate(gpus):
        env = dict(os.environ)
        env.update({
            "CUDA_VISIBLE_DEVICES": gpu,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(len(gpus)),
            "LOCAL_WORLD_SIZE": str(len(gpus)),
            "TOKENIZERS_PARALLELISM": "false",
        })
        log = open(os.path.join(log_dir, f"worker_{local_rank}.attempt{attempt}.log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "worker"] + sys.argv[1:]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def stop_group(procs):
    for p, _ in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + 30
    for p, log in procs:
        try:
            p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


def launch(args):
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    for attempt in range(args.retries + 1):
        procs = start_group(gpus, free_port(), log_dir, attempt)
        print(f"[launcher] attempt {attempt}: pids {[p.pid for p, _ in procs]}", flush=True)
        failed = False
        while True:
            codes = [p.poll() for p, _ in procs]
            if any(c not in (None, 0) for c in codes):
                failed = True
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(5)
        stop_group(procs)
        if not failed:
            print("[launcher] all workers finished", flush=True)
            return 0
        print(f"[launcher] a worker failed (exit codes {codes}), see {log_dir}", flush=True)
    return 1


if __name__ == "__main__":
    args = parse_args()
    if args.role == "worker":
        run_worker(args)
    else:
        sys.exit(launch(args))
