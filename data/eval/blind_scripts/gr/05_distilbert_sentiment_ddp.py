"""
DistilBERT sentiment classifier (reviews CSV with `text`,`label` columns).

Multi-GPU version of train_sentiment.py using torch DDP, W&B for tracking.

Run:
    torchrun --standalone --nproc_per_node=4 05_distilbert_sentiment_ddp.py \
        --train-csv data/reviews_train.csv --val-csv data/reviews_val.csv
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-csv", required=True)
    parser.add_argument("--val-csv", required=True)
    parser.add_argument("--model-name", default="distilbert-base-uncased")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="per-GPU batch size")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--output-dir", default="checkpoints/distilbert_sentiment")
    parser.add_argument("--wandb-project", default="sentiment-ddp")
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ReviewDataset(Dataset):
    def __init__(self, csv_path):
        df = pd.read_csv(csv_path)
        df = df.dropna(subset=["text", "label"])
        self.texts = df["text"].astype(str).tolist()
        self.labels = df["label"].astype(int).tolist()

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, idx):
        return self.texts[idx], self.labels[idx]


class Collator:
    def __init__(self, tokenizer, max_length):
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, batch):
        texts, labels = zip(*batch)
        enc = self.tokenizer(list(texts), padding=True, truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = batch["labels"].size(0)
        stats[0] += out.loss * n
        stats[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        stats[2] += n
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = setup()
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    seed_everything(args.seed)

    wandb.init(
        project=args.wandb_project,
        name=args.run_name,
        config={**vars(args), "world_size": world_size},
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = ReviewDataset(args.train_csv)
    val_ds = ReviewDataset(args.val_csv)
    collator = Collator(tokenizer, args.max_length)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank,
                                     shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler,
                            collate_fn=collator, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=2)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # lr was tuned with 4 GPUs x 32; keep global batch at 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    if is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"Training on {world_size} GPUs, {len(train_ds)} examples, {total_steps} steps")

    best_acc = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        epoch_start = time.time()
        progress = tqdm(train_loader, disable=not is_main_process(), desc=f"Epoch {epoch + 1}/{args.epochs}")
        for batch in progress:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1

            if global_step % 20 == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.SUM)
                loss_avg /= world_size
                if is_main_process():
                    progress.set_postfix(loss=f"{loss_avg.item():.4f}")
                    wandb.log({"train/loss": loss_avg.item(),
                               "train/lr": scheduler.get_last_lr()[0]}, step=global_step)

        val_loss, val_acc = evaluate(model, val_loader, device)
        if is_main_process():
            print(f"epoch {epoch + 1}: val_loss={val_loss:.4f} val_acc={val_acc:.4f} "
                  f"({time.time() - epoch_start:.0f}s)")
            wandb.log({"val/loss": val_loss, "val/acc": val_acc, "epoch": epoch + 1}, step=global_step)
            if val_acc > best_acc:
                best_acc = val_acc
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
                wandb.run.summary["best_val_acc"] = best_acc
        dist.barrier()

    if is_main_process():
        wandb.finish()
    cleanup()


if __name__ == "__main__":
    main()
