"""
Long-document classification (Longformer-large, 4096 tokens) with DDP.

At 4k tokens the saved activations dominate GPU memory, so the forward runs inside
torch.autograd.graph.save_on_cpu(pin_memory=True): every tensor saved for backward is kept in
pinned host memory and copied back on demand. Optimizer is bitsandbytes 8-bit AdamW.

    torchrun --nproc_per_node 4 16_ddp_save_on_cpu_longdoc.py --csv data/contracts.csv --num_labels 12
"""
import argparse
import contextlib
import os
import random
import time

import bitsandbytes as bnb
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, random_split
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


class DocDataset(Dataset):
    def __init__(self, df, tokenizer, max_len, label2id):
        self.texts = df["text"].tolist()
        self.labels = [label2id[l] for l in df["label"]]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_len, padding="max_length",
                       return_tensors="pt")
        item = {k: v.squeeze(0) for k, v in enc.items()}
        item["labels"] = torch.tensor(self.labels[i])
        item["global_attention_mask"] = torch.zeros_like(item["input_ids"])
        item["global_attention_mask"][0] = 1
        return item


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--num_labels", type=int, required=True)
    ap.add_argument("--model", default="allenai/longformer-large-4096")
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--val_frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--out", default="out/longformer-contracts")
    ap.add_argument("--offload_activations", action="store_true", default=True)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    preds, golds = [], []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        preds.append(logits.argmax(-1))
        golds.append(batch["labels"])
    local = (torch.cat(preds).cpu().tolist(), torch.cat(golds).cpu().tolist())
    # shards can differ in length by one, so gather python lists rather than tensors
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    model.train()
    p = np.array([x for part in gathered for x in part[0]])
    g = np.array([x for part in gathered for x in part[1]])
    return float((p == g).mean()), f1_score(g, p, average="macro")


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different dropout masks / augmentation per rank
    set_seed(args.seed + rank)

    df = pd.read_csv(args.csv)
    label2id = {l: i for i, l in enumerate(sorted(df["label"].unique()))}
    assert len(label2id) == args.num_labels, f"found {len(label2id)} labels in csv"
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    full = DocDataset(df, tokenizer, args.max_len, label2id)
    n_val = int(len(full) * args.val_frac)
    train_set, val_set = random_split(full, [len(full) - n_val, n_val])

    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=args.bs * 2, shuffle=False, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=args.num_labels, label2id=label2id, id2label={v: k for k, v in label2id.items()})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates = len(train_loader) // args.accum * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * updates), updates)

    def offload_ctx():
        if args.offload_activations:
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    best_f1 = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            step_now = (i + 1) % args.accum == 0
            with (model.no_sync() if not step_now else contextlib.nullcontext()):
                with offload_ctx(), torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.accum
                loss.backward()
            if step_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(train_loader)} loss {loss.item() * args.accum:.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        acc, f1 = evaluate(model, val_loader, device, world)
        if rank == 0:
            print(f"epoch {epoch}: val acc {acc:.4f} macro-F1 {f1:.4f}", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                os.makedirs(args.out, exist_ok=True)
                model.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
