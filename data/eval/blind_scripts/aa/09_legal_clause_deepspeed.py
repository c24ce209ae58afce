"""Contract clause-type classification with a BERT encoder under DeepSpeed ZeRO-2.

hostfile:
    gpu-node01 slots=8
    gpu-node02 slots=8

    deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 09_legal_clause_deepspeed.py \
        --data_dir /lustre/proj/clauses --save_dir /lustre/proj/ckpt/clauses
"""
import argparse
import json
import os
import random

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer

MICRO_BS = 16
GRAD_ACCUM = 2


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--model", default="nlpaueb/legal-bert-base-uncased")
    p.add_argument("--max_len", type=int, default=384)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return p.parse_args()


def ds_config(args, total_steps):
    return {
        "train_batch_size": 256,
        "train_micro_batch_size_per_gpu": MICRO_BS,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e7},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                          "warmup_num_steps": int(0.06 * total_steps),
                                                          "total_num_steps": total_steps}},
        "steps_per_print": 200,
        "wall_clock_breakdown": False,
    }


def load_clauses(data_dir):
    rows = []
    for name in sorted(os.listdir(data_dir)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(data_dir, name)) as f:
            for line in f:
                r = json.loads(line)
                rows.append({"contract": name[:-6], "text": r["clause_text"], "label": r["clause_type"]})
    df = pd.DataFrame(rows)
    df["text"] = df["text"].str.replace(r"\s+", " ", regex=True).str.strip()
    df = df[df["text"].str.len() > 20]
    vc = df["label"].value_counts()
    df.loc[df["label"].isin(vc[vc < 25].index), "label"] = "other"
    return df.reset_index(drop=True)


class ClauseDataset(Dataset):
    def __init__(self, df, tokenizer, label2id, max_len):
        self.enc = tokenizer(df["text"].tolist(), truncation=True, max_length=max_len, padding="max_length",
                             return_tensors="pt")
        self.labels = torch.tensor([label2id[l] for l in df["label"]])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.enc["input_ids"][i], "attention_mask": self.enc["attention_mask"][i],
                "labels": self.labels[i]}


def evaluate(engine, loader):
    engine.eval()
    stats = torch.zeros(3, device=engine.device)
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            out = engine(**batch)
            stats[0] += out.loss.float() * batch["labels"].size(0)
            stats[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
            stats[2] += batch["labels"].size(0)
    dist.all_reduce(stats)
    engine.train()
    return {"loss": (stats[0] / stats[2]).item(), "acc": (stats[1] / stats[2]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    df = load_clauses(args.data_dir)
    # split by contract so clauses of one document never land in both splits
    contracts = sorted(df["contract"].unique())
    tr_c, va_c = train_test_split(contracts, test_size=0.1, random_state=args.seed)
    train_df, val_df = df[df["contract"].isin(tr_c)], df[df["contract"].isin(va_c)]
    labels = sorted(df["label"].unique())
    label2id = {l: i for i, l in enumerate(labels)}
    if rank == 0:
        print(f"{len(train_df)} train / {len(val_df)} val clauses, {len(labels)} types", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = ClauseDataset(train_df, tokenizer, label2id, args.max_len)
    val_ds = ClauseDataset(val_df, tokenizer, label2id, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=MICRO_BS, sampler=train_sampler, num_workers=4, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=label2id)
    total_steps = args.epochs * len(train_dl) // GRAD_ACCUM
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args, total_steps))

    start_epoch = 0
    load_path, client_state = engine.load_checkpoint(args.save_dir)
    if load_path is not None:
        start_epoch = client_state["epoch"] + 1
        if rank == 0:
            print(f"resumed from {load_path}", flush=True)

    best_acc = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
        metrics = evaluate(engine, val_dl)
        if rank == 0:
            print(f"epoch {epoch} val {metrics}", flush=True)
        engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch, **metrics})
        if metrics["acc"] > best_acc:
            best_acc = metrics["acc"]
            engine.save_checkpoint(args.save_dir, tag="best", client_state={"epoch": epoch, **metrics},
                                   save_latest=False)

    if rank == 0:
        with open(os.path.join(args.save_dir, "labels.json"), "w") as f:
            json.dump(labels, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
