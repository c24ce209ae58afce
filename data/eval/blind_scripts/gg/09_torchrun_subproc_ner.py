#!/usr/bin/env python3
"""Token classification (NER) fine-tuning with a self-contained torchrun wrapper.

    python 09_torchrun_subproc_ner.py --gpus 4 --dataset conll2003 --model roberta-large

Wrapper mode re-executes this file under torchrun (`--run-worker`), one
process per GPU, keeping per-rank logs in <out>/torchrun_logs/<attempt>/ and
retrying failed runs. Worker mode trains and keeps the best checkpoint by
entity-level F1 on the validation split.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_from_disk
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer,
                          DataCollatorForTokenClassification, get_cosine_schedule_with_warmup)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-worker", action="store_true")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--dataset", default="data/conll2003_tokenized",
                    help="output of datasets.save_to_disk with input_ids/labels already aligned")
    ap.add_argument("--model", default="roberta-large")
    ap.add_argument("--out", default="runs/ner")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def decode(preds, labels, id2label):
    true_seqs, pred_seqs = [], []
    for p_row, l_row in zip(preds, labels):
        t, q = [], []
        for p, l in zip(p_row, l_row):
            if l == -100:
                continue
            t.append(id2label[int(l)])
            q.append(id2label[int(p)])
        true_seqs.append(t)
        pred_seqs.append(q)
    return true_seqs, pred_seqs


@torch.no_grad()
def evaluate(model, loader, device, id2label):
    model.eval()
    all_true, all_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits
        preds = logits.argmax(-1).cpu().numpy()
        labels = batch["labels"].cpu().numpy()
        t, p = decode(preds, labels, id2label)
        all_true.extend(t)
        all_pred.extend(p)
    model.train()
    return {"f1": f1_score(all_true, all_pred), "precision": precision_score(all_true, all_pred),
            "recall": recall_score(all_true, all_pred)}


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    ds = load_from_disk(args.dataset)
    label_names = ds["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_names))
    tokenizer = AutoTokenizer.from_pretrained(args.model, add_prefix_space=True)
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    cols = ["input_ids", "attention_mask", "labels"]
    train_ds = ds["train"].with_format(columns=cols)
    val_ds = ds["validation"].with_format(columns=cols)

    per_gpu = args.global_batch // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, collate_fn=collator,
                              num_workers=2, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, collate_fn=collator, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_names), id2label=id2label,
        label2id={v: k for k, v in id2label.items()}).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.1 * total), total)

    best_f1 = -1.0
    best_dir = os.path.join(args.out, "best")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model.module, val_loader, device, id2label)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val f1 {metrics['f1']:.4f} "
                  f"p {metrics['precision']:.4f} r {metrics['recall']:.4f}", flush=True)
            if metrics["f1"] > best_f1:
                best_f1 = metrics["f1"]
                tmp = best_dir + ".tmp"
                model.module.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                shutil.rmtree(best_dir, ignore_errors=True)
                os.rename(tmp, best_dir)
                print(f"new best f1 {best_f1:.4f} saved to {best_dir}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


def wrapper(args):
    os.makedirs(args.out, exist_ok=True)
    base = [sys.executable, "-m", "torch.distributed.run"]
    for attempt in range(args.retries + 1):
        log_dir = os.path.join(args.out, "torchrun_logs", str(attempt))
        cmd = base + ["--standalone", f"--nproc-per-node={args.gpus}", f"--log-dir={log_dir}",
                      "--redirects=3", "--tee=1", os.path.abspath(__file__), "--run-worker", *sys.argv[1:]]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="4")
        print(f"[wrapper] attempt {attempt}", flush=True)
        rc = subprocess.run(cmd, env=env).returncode
        if rc == 0:
            return 0
        print(f"[wrapper] torchrun exited with {rc}; per-rank logs: {log_dir}", flush=True)
        time.sleep(10)
    return 1


if __name__ == "__main__":
    a = parse()
    sys.exit(worker(a) if a.run_worker else wrapper(a))
