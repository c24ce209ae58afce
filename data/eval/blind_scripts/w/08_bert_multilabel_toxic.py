"""
Multi-label toxic comment classification (Jigsaw) with a BERT encoder + custom head.
Started from a Kaggle notebook, moved to DDP to use all 4 GPUs of the lab server.

    torchrun --nproc_per_node=4 08_bert_multilabel_toxic.py --train_csv data/train.csv
"""
import argparse
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

LABELS = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_csv", default="data/train.csv")
    ap.add_argument("--model_name", default="bert-base-uncased")
    ap.add_argument("--max_len", type=int, default=192)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--out", default="toxic_bert_best.pt")
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CommentDataset(Dataset):
    def __init__(self, texts, labels, tokenizer, max_len):
        self.texts = texts
        self.labels = labels
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tokenizer(
            self.texts[i], truncation=True, max_length=self.max_len,
            padding="max_length", return_tensors="pt",
        )
        return {
            "input_ids": enc["input_ids"].squeeze(0),
            "attention_mask": enc["attention_mask"].squeeze(0),
            "labels": torch.tensor(self.labels[i], dtype=torch.float),
        }


class ToxicClassifier(nn.Module):
    def __init__(self, model_name, n_labels, dropout):
        super().__init__()
        self.bert = AutoModel.from_pretrained(model_name)
        hidden = self.bert.config.hidden_size
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, n_labels)

    def forward(self, input_ids, attention_mask):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        cls = out.last_hidden_state[:, 0]  # [CLS] token
        return self.classifier(self.dropout(cls))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)

    df = pd.read_csv(args.train_csv)
    train_df, val_df = train_test_split(df, test_size=0.1, random_state=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = CommentDataset(train_df.comment_text.tolist(), train_df[LABELS].values, tokenizer, args.max_len)
    val_ds = CommentDataset(val_df.comment_text.tolist(), val_df[LABELS].values, tokenizer, args.max_len)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=128, shuffle=False, num_workers=4, pin_memory=True)

    model = ToxicClassifier(args.model_name, len(LABELS), args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    criterion = nn.BCEWithLogitsLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    num_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * num_steps), num_steps)
    scaler = torch.cuda.amp.GradScaler()

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(1, device=device)
        loop = tqdm(train_loader, desc=f"Epoch {epoch + 1}", disable=rank != 0)
        for batch in loop:
            ids = batch["input_ids"].to(device, non_blocking=True)
            mask = batch["attention_mask"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)

            optimizer.zero_grad()
            with torch.cuda.amp.autocast():
                logits = model(ids, mask)
                loss = criterion(logits, labels)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            loss_sum += loss.detach()
            loop.set_postfix(loss=loss.item())

        dist.all_reduce(loss_sum)
        mean_loss = loss_sum.item() / (len(train_loader) * world_size)

        # full validation on rank 0 only; AUC needs all predictions anyway
        if rank == 0:
            model.eval()
            all_probs, all_labels = [], []
            with torch.no_grad():
                for batch in tqdm(val_loader, desc="Validating"):
                    logits = model.module(batch["input_ids"].to(device), batch["attention_mask"].to(device))
                    all_probs.append(torch.sigmoid(logits.float()).cpu().numpy())
                    all_labels.append(batch["labels"].numpy())
            probs = np.concatenate(all_probs)
            labels_np = np.concatenate(all_labels)
            aucs = [roc_auc_score(labels_np[:, j], probs[:, j]) for j in range(len(LABELS))]
            mean_auc = float(np.mean(aucs))
            print(f"epoch {epoch + 1}: train loss {mean_loss:.4f}, val mean AUC {mean_auc:.4f}")
            print("   per label: " + ", ".join(f"{l}={a:.3f}" for l, a in zip(LABELS, aucs)))
            if mean_auc > best_auc:
                best_auc = mean_auc
                torch.save(model.module.state_dict(), args.out)
                print(f"   saved best model to {args.out}")
        dist.barrier()

    if rank == 0:
        print(f"finished, best val AUC {best_auc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
