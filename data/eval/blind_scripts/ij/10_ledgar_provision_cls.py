"""LEDGAR contract provision classification (100 classes, LexGLUE) with DeBERTa-v3.

torchrun --nproc_per_node=4 10_ledgar_provision_cls.py --wandb_project legal-provisions --run_name debv3-base-ledgar
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="microsoft/deberta-v3-base")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--warmup_ratio", type=float, default=0.06)
    p.add_argument("--label_smoothing", type=float, default=0.05)
    p.add_argument("--output_dir", default="checkpoints/ledgar")
    p.add_argument("--wandb_project", default="legal-provisions")
    p.add_argument("--run_name", default=None)
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


class EvalShardSampler(Sampler):
    """Every index exactly once across ranks (no padding)."""

    def __init__(self, dataset, rank, world_size):
        self.idx = list(range(len(dataset)))[rank::world_size]

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    preds, golds = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        preds.append(logits.argmax(-1).cpu())
        golds.append(labels.cpu())
    local = (torch.cat(preds).numpy(), torch.cat(golds).numpy())
    shards = [None] * world_size
    dist.all_gather_object(shards, local)
    y_pred = np.concatenate([s[0] for s in shards])
    y_true = np.concatenate([s[1] for s in shards])
    model.train()
    return {"micro_f1": f1_score(y_true, y_pred, average="micro"),
            "macro_f1": f1_score(y_true, y_pred, average="macro"),
            "n": int(len(y_true))}


def main():
    args = get_args()
    rank, world_size, local_rank = setup()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.wandb_project, name=args.run_name,
                     config={**vars(args), "world_size": world_size})

    ds = load_dataset("lex_glue", "ledgar")
    num_labels = ds["train"].features["label"].num_classes
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def tok(batch):
        return tokenizer(batch["text"], truncation=True, max_length=args.max_length)

    if rank == 0:
        ds = ds.map(tok, batched=True, remove_columns=["text"])
        dist.barrier()
    else:
        dist.barrier()
        ds = ds.map(tok, batched=True, remove_columns=["text"])
    ds = ds.rename_column("label", "labels")

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(ds["train"], shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(ds["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    val_loader = DataLoader(ds["validation"], batch_size=64, sampler=EvalShardSampler(ds["validation"], rank, world_size),
                            collate_fn=collator, num_workers=4)
    test_loader = DataLoader(ds["test"], batch_size=64, sampler=EvalShardSampler(ds["test"], rank, world_size),
                             collate_fn=collator, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total), total)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**batch).logits
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=args.label_smoothing)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0 and rank == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0],
                           "train/sec_per_step": (time.time() - tic) / 50}, step=step)
                tic = time.time()

        val = evaluate(model.module, val_loader, device, world_size)
        if rank == 0:
            wandb.log({f"val/{k}": v for k, v in val.items()}, step=step)
            print(f"epoch {epoch} val {val}", flush=True)
            if val["macro_f1"] > best:
                best = val["macro_f1"]
                os.makedirs(args.output_dir, exist_ok=True)
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
                run.summary["best_val_macro_f1"] = best
        dist.barrier()

    test = evaluate(model.module, test_loader, device, world_size)
    if rank == 0:
        wandb.log({f"test/{k}": v for k, v in test.items()}, step=step)
        print(f"test (last epoch weights) {test}", flush=True)
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
