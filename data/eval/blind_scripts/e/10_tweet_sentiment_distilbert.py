"""Fine-tune DistilBERT on a tweet sentiment CSV (text,label with 3 classes).

torchrun --nproc_per_node=2 10_tweet_sentiment_distilbert.py \
    --train_csv data/tweets_train.csv --val_csv data/tweets_val.csv
"""
import argparse
import math
import os

import pandas as pd
import torch
import torch.distributed as dist
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="distilbert-base-uncased")
    parser.add_argument("--train_csv", default="data/tweets_train.csv")
    parser.add_argument("--val_csv", default="data/tweets_val.csv")
    parser.add_argument("--max_len", type=int, default=96)
    parser.add_argument("--global_batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--warmup_ratio", type=float, default=0.06)
    parser.add_argument("--output_dir", default="outputs/distilbert-tweets")
    parser.add_argument("--seed", type=int, default=17)
    return parser.parse_args()


class TweetDataset(Dataset):
    def __init__(self, df, tokenizer, max_len):
        self.enc = tokenizer(df["text"].astype(str).tolist(), truncation=True, max_length=max_len,
                             padding="max_length", return_tensors="pt")
        self.labels = torch.tensor(df["label"].values, dtype=torch.long)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        return {"input_ids": self.enc["input_ids"][idx],
                "attention_mask": self.enc["attention_mask"][idx],
                "labels": self.labels[idx]}


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_df = pd.read_csv(args.train_csv)
    val_df = pd.read_csv(args.val_csv)
    train_ds = TweetDataset(train_df, tokenizer, args.max_len)
    val_ds = TweetDataset(val_df, tokenizer, args.max_len)

    per_device_bs = args.global_batch_size // world_size
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=per_device_bs, sampler=train_sampler, num_workers=2)
    val_loader = DataLoader(val_ds, batch_size=128, shuffle=False, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=3).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total_steps), total_steps)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        progress = tqdm(train_loader, disable=rank != 0, desc=f"epoch {epoch + 1}")
        for batch in progress:
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.set_postfix(loss=f"{out.loss.item():.4f}")

        if rank == 0:
            model.eval()
            preds, labels = [], []
            with torch.no_grad():
                for batch in val_loader:
                    labels.append(batch.pop("labels"))
                    batch = {k: v.to(device) for k, v in batch.items()}
                    preds.append(model.module(**batch).logits.argmax(-1).cpu())
            preds, labels = torch.cat(preds).numpy(), torch.cat(labels).numpy()
            f1 = f1_score(labels, preds, average="macro")
            acc = (preds == labels).mean()
            print(f"epoch {epoch + 1}: val macro-F1 {f1:.4f} acc {acc:.4f}")
            if f1 > best_f1:
                best_f1 = f1
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
