"""Loss-prioritised data selection for MNLI fine-tuning (RoBERTa), multi-GPU.

Each epoch trains on a fraction of the training set, drawn without replacement
with probability proportional to (recent loss) ** alpha, so well-learned pairs
are visited less often.  Every sample starts with the same prior loss.

    torchrun --nproc_per_node=8 07_prioritized_subset_nli.py --model roberta-large \
        --keep-frac 0.5 --epochs 6 --output-dir out/mnli_prio
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          get_linear_schedule_with_warmup)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="roberta-base")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="per device")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--keep-frac", type=float, default=0.5)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--prio-start", type=int, default=1, help="first epoch that uses the loss table")
    p.add_argument("--output-dir", default="out/mnli_prio")
    p.add_argument("--seed", type=int, default=13)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class WithIdx(torch.utils.data.Dataset):
    def __init__(self, hf_ds):
        self.ds = hf_ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        item = dict(self.ds[i])
        item["idx"] = i
        return item


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        c[0] += (logits.argmax(-1) == labels).sum()
        c[1] += labels.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def encode(ex):
        return tokenizer(ex["premise"], ex["hypothesis"], truncation=True, max_length=args.max_length)

    def prepare():
        raw = load_dataset("glue", "mnli")
        cols = ["premise", "hypothesis", "idx"]
        tr = raw["train"].map(encode, batched=True, remove_columns=cols).rename_column("label", "labels")
        dv = raw["validation_matched"].map(encode, batched=True, remove_columns=cols).rename_column("label", "labels")
        return tr, dv

    # rank 0 downloads and fills the map cache; the others then read it
    if rank == 0:
        train, dev = prepare()
    dist.barrier()
    if rank != 0:
        train, dev = prepare()
    n = len(train)

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    dev_loader = DataLoader(Subset(dev, range(rank, len(dev), world)), batch_size=128, collate_fn=collator)
    train_ds = WithIdx(train)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=3).to(device)
    model = DDP(model, device_ids=[local_rank])

    chunk = world * args.batch_size
    n_keep = max(chunk, (int(args.keep_frac * n) // chunk) * chunk)
    steps_per_epoch = n_keep // chunk
    total = steps_per_epoch * args.epochs
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for nm, p in model.named_parameters() if not any(k in nm for k in no_decay)], "weight_decay": 0.1},
        {"params": [p for nm, p in model.named_parameters() if any(k in nm for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    loss_table = torch.full((n,), math.log(3.0), device=device)
    for epoch in range(args.epochs):
        if epoch < args.prio_start:
            probs = torch.ones(n, device=device)
        else:
            probs = loss_table.clamp(min=1e-4).pow(args.alpha)
        probs = probs / probs.sum()
        subset = torch.multinomial(probs, n_keep, replacement=False)
        mine = subset[rank::world].tolist()
        loader = DataLoader(Subset(train_ds, mine), batch_size=args.batch_size, shuffle=True,
                            collate_fn=collator, num_workers=2, drop_last=True)

        model.train()
        s = torch.zeros(n, device=device)
        cnt = torch.zeros(n, device=device)
        for step, batch in enumerate(loader):
            idx = batch.pop("idx").to(device)
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**batch).logits
            per = F.cross_entropy(logits.float(), labels, reduction="none")
            loss = per.mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            s.index_add_(0, idx, per.detach())
            cnt.index_add_(0, idx, torch.ones_like(per))
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

        dist.all_reduce(s)
        dist.all_reduce(cnt)
        seen = cnt > 0
        loss_table[seen] = s[seen] / cnt[seen]

        acc = evaluate(model.module, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: dev-m acc {acc:.4f}, visited {seen.sum().item()}/{n}", flush=True)
            out = os.path.join(args.output_dir, f"epoch{epoch}")
            model.module.save_pretrained(out)
            tokenizer.save_pretrained(out)
            torch.save(loss_table.cpu(), os.path.join(out, "loss_table.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
