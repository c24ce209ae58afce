"""Support-ticket intent classifier, fine-tuned on Vertex AI custom training.

Worker pool 0: 1 x a2-highgpu-4g, worker pool 1: 1 x a2-highgpu-4g. Container args:

    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$RANK \
             --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT \
             -m trainer.task --train-csv /gcs/acme-ml-data/tickets/tickets_2024.csv

Vertex sets RANK/WORLD_SIZE per replica (node), torchrun turns that into per-GPU ranks.
The bucket is visible through Cloud Storage FUSE under /gcs/.
"""
import argparse
import logging
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("trainer")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-csv", required=True)
    parser.add_argument("--model-name", default="distilroberta-base")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--model-dir", default=os.environ.get("AIP_MODEL_DIR", "/gcs/acme-ml-models/tickets"))
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def gcs_to_fuse(path):
    # AIP_MODEL_DIR is a gs:// URI; write through the FUSE mount instead.
    if path.startswith("gs://"):
        return "/gcs/" + path[len("gs://"):]
    return path


class TicketDataset(Dataset):
    def __init__(self, texts, labels, tokenizer, max_length):
        self.enc = tokenizer(texts, truncation=True, max_length=max_length, padding="max_length")
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        item = {k: torch.tensor(v[idx]) for k, v in self.enc.items()}
        item["labels"] = torch.tensor(self.labels[idx])
        return item


def evaluate(model, loader, device, num_labels):
    model.eval()
    confusion = torch.zeros(num_labels, num_labels, device=device, dtype=torch.long)
    loss_sum = torch.zeros(2, device=device)
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch)
            preds = out.logits.argmax(-1)
            idx = batch["labels"] * num_labels + preds
            confusion += torch.bincount(idx, minlength=num_labels * num_labels).view(num_labels, num_labels)
            loss_sum[0] += out.loss * batch["labels"].size(0)
            loss_sum[1] += batch["labels"].size(0)
    dist.all_reduce(confusion)
    dist.all_reduce(loss_sum)
    model.train()
    tp = confusion.diag().float()
    precision = tp / confusion.sum(0).clamp(min=1)
    recall = tp / confusion.sum(1).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-8)
    acc = tp.sum() / confusion.sum()
    return (loss_sum[0] / loss_sum[1]).item(), acc.item(), f1.mean().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation / dropout noise per rank
    set_seed(args.seed + rank)

    df = pd.read_csv(args.train_csv)
    df = df.dropna(subset=["body", "intent"])
    labels_sorted = sorted(df["intent"].unique())
    label2id = {l: i for i, l in enumerate(labels_sorted)}
    texts = (df["subject"].fillna("") + " \n " + df["body"]).tolist()
    labels = [label2id[l] for l in df["intent"]]

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    full = TicketDataset(texts, labels, tokenizer, args.max_length)
    n_val = int(len(full) * args.val_fraction)
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val])
    if rank == 0:
        log.info("%d train / %d val examples, %d intents", len(train_ds), len(val_ds), len(label2id))

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=len(label2id),
        id2label={i: l for l, i in label2id.items()}, label2id=label2id,
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total_steps), total_steps)

    best_f1 = -1.0
    out_dir = gcs_to_fuse(args.model_dir)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
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
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        val_loss, val_acc, val_f1 = evaluate(model, val_loader, device, len(label2id))
        if rank == 0:
            log.info("epoch %d val_loss %.4f acc %.4f macro_f1 %.4f", epoch, val_loss, val_acc, val_f1)
            if val_f1 > best_f1:
                best_f1 = val_f1
                os.makedirs(out_dir, exist_ok=True)
                model.module.save_pretrained(out_dir)
                tokenizer.save_pretrained(out_dir)
                log.info("saved new best model to %s", out_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
