"""BERT-base fine-tuning for intent classification, LAMB vs AdamW at large batch.

Input CSVs have columns `text,label` with string labels.

    torchrun --nproc_per_node=8 lamb_text_cls.py --train data/intents/train.csv \
        --dev data/intents/dev.csv --opt lamb --lr 2e-3 --batch-size 64
"""
import argparse
import json
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch_optimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


class TextDataset(Dataset):
    def __init__(self, texts, labels, tokenizer, max_len):
        self.enc = tokenizer(list(texts), truncation=True, max_length=max_len, padding="max_length",
                             return_tensors="pt")
        self.labels = torch.tensor(labels, dtype=torch.long)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.enc["input_ids"][i], "attention_mask": self.enc["attention_mask"][i],
                "labels": self.labels[i]}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", default="runs/intent_lamb")
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--opt", choices=["lamb", "adamw"], default="lamb")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup-ratio", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=13)
    return ap.parse_args()


def build_optimizer(args, model):
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": args.wd},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    if args.opt == "lamb":
        return torch_optimizer.Lamb(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
    return torch.optim.AdamW(groups, lr=args.lr, eps=1e-6)


@torch.no_grad()
def evaluate(model, loader, device, num_labels):
    model.eval()
    confusion = torch.zeros(num_labels, num_labels, device=device, dtype=torch.long)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        pred = logits.argmax(-1)
        idx = batch["labels"] * num_labels + pred
        confusion += torch.bincount(idx, minlength=num_labels ** 2).view(num_labels, num_labels)
    dist.all_reduce(confusion)
    model.train()
    tp = confusion.diag().float()
    precision = tp / confusion.sum(0).clamp(min=1)
    recall = tp / confusion.sum(1).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-8)
    return (tp.sum() / confusion.sum()).item(), f1.mean().item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_df = pd.read_csv(args.train)
    dev_df = pd.read_csv(args.dev)
    label_names = list(set(train_df["label"]))
    label2id = {name: i for i, name in enumerate(label_names)}
    num_labels = len(label_names)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_set = TextDataset(train_df["text"], [label2id[l] for l in train_df["label"]], tokenizer, args.max_len)
    dev_set = TextDataset(dev_df["text"], [label2id[l] for l in dev_df["label"]], tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=256, sampler=DistributedSampler(dev_set, shuffle=False))

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=num_labels, id2label=dict(enumerate(label_names)), label2id=label2id).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = build_optimizer(args, model.module)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} train / {len(dev_set)} dev, {num_labels} labels, "
              f"global batch {args.batch_size * world}, opt {args.opt}", flush=True)

    best_f1 = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(**batch)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_sum += torch.stack([out.loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)
        acc, macro_f1 = evaluate(model, dev_loader, device, num_labels)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} dev acc {acc:.4f} "
                  f"macro-F1 {macro_f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if macro_f1 > best_f1:
                best_f1 = macro_f1
                model.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
                with open(os.path.join(args.out, "labels.json"), "w") as f:
                    json.dump(label_names, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
