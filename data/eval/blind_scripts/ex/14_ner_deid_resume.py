#!/usr/bin/env python
"""
PHI de-identification tagger (i2b2-2014 categories + our local ones) on DeBERTa-v3.
Jobs on the shared queue are pre-empted after 24h, so training writes a full checkpoint every
--save_every steps and picks up from it with --resume.

    torchrun --nproc_per_node=4 14_ner_deid_resume.py --data data/deid_2014 --ckpt_dir ckpt/deid \
        [--resume ckpt/deid/latest.pt]
"""
import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                          get_linear_schedule_with_warmup)

PHI = ["NAME", "PROFESSION", "LOCATION", "AGE", "DATE", "CONTACT", "ID", "HOSPITAL", "DOCTOR"]
LABELS = ["O"] + [f"{p}-{c}" for c in PHI for p in ("B", "I")]


def load_jsonl(path, tokenizer, max_len):
    feats = []
    for line in open(path):
        ex = json.loads(line)
        enc = tokenizer(ex["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
        lab, prev = [], None
        for w in enc.word_ids():
            lab.append(-100 if w is None or w == prev else LABELS.index(ex["tags"][w]))
            prev = w
        feats.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": lab})
    return feats


class ListDataset(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch, step, best):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "epoch": epoch, "step": step, "best": best}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    gold, pred = [], []
    for batch in loader:
        labels = batch.pop("labels")
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.argmax(-1).cpu()
        for p, g in zip(logits.tolist(), labels.tolist()):
            gold.append([LABELS[x] for x in g if x != -100])
            pred.append([LABELS[x] for x, y in zip(p, g) if y != -100])
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (gold, pred))
    gold = [s for g, _ in everything for s in g]
    pred = [s for _, p in everything for s in p]
    return f1_score(gold, pred), classification_report(gold, pred, digits=4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--model", default="microsoft/deberta-v3-base")
    ap.add_argument("--max_len", type=int, default=384)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=2014)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = ListDataset(load_jsonl(os.path.join(args.data, "train.jsonl"), tokenizer, args.max_len))
    dev_ds = ListDataset(load_jsonl(os.path.join(args.data, "dev.jsonl"), tokenizer, args.max_len))
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                          num_workers=4, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=32, collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)),
        label2id={l: i for i, l in enumerate(LABELS)}).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, global_step, best = 0, 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, global_step, best = ckpt["epoch"], ckpt["step"], ckpt["best"]
        del ckpt
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, step {global_step}, best F1 {best:.4f}", flush=True)
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    steps_per_epoch = len(train_dl)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        skip = global_step - epoch * steps_per_epoch   # batches already done in this epoch before pre-emption
        t0 = time.time()
        for i, batch in enumerate(train_dl):
            if i < skip:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1
            if rank == 0 and global_step % 100 == 0:
                print(f"step {global_step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            if global_step % args.save_every == 0 and rank == 0:
                save_checkpoint(os.path.join(args.ckpt_dir, "latest.pt"), model, optimizer, scheduler, scaler,
                                epoch, global_step, best)

        f1, report = evaluate(model.module, dev_dl, device)
        if rank == 0:
            print(f"epoch {epoch} dev F1 {f1:.4f}\n{report}", flush=True)
            save_checkpoint(os.path.join(args.ckpt_dir, "latest.pt"), model, optimizer, scheduler, scaler,
                            epoch + 1, global_step, max(best, f1))
            if f1 > best:
                shutil.copyfile(os.path.join(args.ckpt_dir, "latest.pt"), os.path.join(args.ckpt_dir, "best.pt"))
        best = max(best, f1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
