"""Multilingual intent classifier (XLM-R base) on the support-chat corpus.

Runs on Kubernetes as an Indexed Job with 3 completions / parallelism 3, one pod
per node, 8 GPUs per pod. The pods share a headless service "intent-train", so
pod 0 is reachable as intent-train-0.intent-train. Each pod has an emptyDir on
the node's NVMe mounted at /cache for the tokenized dataset.

    command: ["bash", "-c"]
    args:
      - >
        torchrun --nnodes=3 --nproc_per_node=8
        --node_rank=$JOB_COMPLETION_INDEX
        --master_addr=intent-train-0.intent-train --master_port=23456
        /app/train_intent.py --train /data/intents/train.parquet
        --valid /data/intents/valid.parquet --cache /cache --out /models/intent-xlmr
"""
import argparse
import hashlib
import json
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--cache", default="/cache")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="xlm-roberta-base")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def load_label_map(train_path):
    # label ids are fixed by the sorted label names of the training file
    labels = sorted(pd.read_parquet(train_path, columns=["intent"])["intent"].unique())
    return {l: i for i, l in enumerate(labels)}


def tokenized(path, tok, label2id, max_len, cache_dir):
    key = hashlib.md5(f"{path}:{tok.name_or_path}:{max_len}".encode()).hexdigest()[:12]
    cache_file = os.path.join(cache_dir, f"{os.path.basename(path)}.{key}.pt")
    if not os.path.exists(cache_file):
        df = pd.read_parquet(path)
        enc = tok(df["text"].tolist(), truncation=True, max_length=max_len,
                  padding="max_length", return_tensors="pt")
        labels = torch.tensor([label2id[l] for l in df["intent"]], dtype=torch.long)
        torch.save({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                    "labels": labels}, cache_file)
    blob = torch.load(cache_file)
    return TensorDataset(blob["input_ids"], blob["attention_mask"], blob["labels"])


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    preds, golds = [], []
    for ids, mask, y in loader:
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        preds.append(logits.argmax(-1))
        golds.append(y.to(device))
    preds, golds = torch.cat(preds), torch.cat(golds)
    # gather everything so F1 is computed over the full validation set
    n = torch.tensor([preds.numel()], device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    maxn = int(max(s.item() for s in sizes))
    pad = lambda t: torch.cat([t, t.new_full((maxn - t.numel(),), -1)])
    all_p = [torch.empty(maxn, dtype=torch.long, device=device) for _ in range(world)]
    all_g = [torch.empty(maxn, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(all_p, pad(preds))
    dist.all_gather(all_g, pad(golds))
    p = torch.cat([a[: s.item()] for a, s in zip(all_p, sizes)]).cpu().numpy()
    g = torch.cat([a[: s.item()] for a, s in zip(all_g, sizes)]).cpu().numpy()
    model.train()
    return (p == g).mean(), f1_score(g, p, average="macro")


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    label2id = load_label_map(args.train)
    os.makedirs(args.cache, exist_ok=True)
    train_ds = tokenized(args.train, tok, label2id, args.max_len, args.cache)
    val_ds = tokenized(args.valid, tok, label2id, args.max_len, args.cache)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=256, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(label2id),
        id2label={i: l for l, i in label2id.items()}, label2id=label2id,
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.bs / 256, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    best_f1 = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (ids, mask, y) in enumerate(train_dl):
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(input_ids=ids, attention_mask=mask, labels=y).loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(running)
        acc, f1 = evaluate(model.module, val_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch}: train_loss {running[0] / running[1]:.4f} val_acc {acc:.4f} "
                  f"macro_f1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                model.module.save_pretrained(args.out)
                tok.save_pretrained(args.out)
                with open(os.path.join(args.out, "metrics.json"), "w") as fh:
                    json.dump({"epoch": epoch, "acc": float(acc), "macro_f1": float(f1)}, fh)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
