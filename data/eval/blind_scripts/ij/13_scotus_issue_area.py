"""SCOTUS issue-area classification (LexGLUE `scotus`, 14 classes).

Opinions are far longer than 512 tokens; we use head+tail truncation
(first 128 + last 382 word pieces), which works about as well as hierarchical
models on this task at a fraction of the cost.

    torchrun --nproc_per_node=4 13_scotus_issue_area.py --out runs/scotus_headtail
"""
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("scotus")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nlpaueb/legal-bert-base-uncased")
    p.add_argument("--head", type=int, default=128)
    p.add_argument("--tail", type=int, default=382)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--out", default="runs/scotus_headtail")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def set_seed(s):
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    torch.cuda.manual_seed_all(s)


class HeadTailCollator:
    def __init__(self, tok, head, tail):
        self.tok, self.head, self.tail = tok, head, tail

    def __call__(self, examples):
        rows = []
        for ex in examples:
            ids = self.tok(ex["text"], add_special_tokens=False, truncation=False)["input_ids"]
            if len(ids) > self.head + self.tail:
                ids = ids[:self.head] + ids[-self.tail:]
            rows.append(self.tok.build_inputs_with_special_tokens(ids))
        max_len = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), max_len), self.tok.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, :len(r)] = torch.tensor(r)
        return {
            "input_ids": input_ids,
            "attention_mask": (input_ids != self.tok.pad_token_id).long(),
            "labels": torch.tensor([ex["label"] for ex in examples]),
        }


@torch.no_grad()
def evaluate(model, loader, device, n_total, world_size):
    model.eval()
    preds, golds = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        preds.append(out.logits.argmax(-1))
        golds.append(batch["labels"])
    preds, golds = torch.cat(preds), torch.cat(golds)
    gp = [torch.empty_like(preds) for _ in range(world_size)]
    gg = [torch.empty_like(golds) for _ in range(world_size)]
    dist.all_gather(gp, preds)
    dist.all_gather(gg, golds)
    # DistributedSampler(shuffle=False) deals indices round-robin; undo that and drop padding
    p = torch.stack(gp, 1).reshape(-1)[:n_total].cpu().numpy()
    g = torch.stack(gg, 1).reshape(-1)[:n_total].cpu().numpy()
    model.train()
    return {"micro_f1": f1_score(g, p, average="micro"), "macro_f1": f1_score(g, p, average="macro")}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    set_seed(args.seed)

    ds = load_dataset("lex_glue", "scotus")
    num_labels = ds["train"].features["label"].num_classes
    tok = AutoTokenizer.from_pretrained(args.model)
    collate = HeadTailCollator(tok, args.head, args.tail)

    train_sampler = DistributedSampler(ds["train"], num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed)
    train_loader = DataLoader(ds["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    val_loader = DataLoader(ds["validation"], batch_size=32,
                            sampler=DistributedSampler(ds["validation"], shuffle=False),
                            collate_fn=collate, num_workers=4)
    test_loader = DataLoader(ds["test"], batch_size=32,
                             sampler=DistributedSampler(ds["test"], shuffle=False),
                             collate_fn=collate, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)

    # SCOTUS is heavily imbalanced; inverse-sqrt-frequency class weights
    counts = np.bincount(ds["train"]["label"], minlength=num_labels).astype(np.float64)
    weights = torch.tensor((counts.sum() / np.maximum(counts, 1)) ** 0.5, dtype=torch.float, device=device)
    loss_fn = torch.nn.CrossEntropyLoss(weight=weights / weights.mean())

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best, bad = -1.0, 0
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = loss_fn(logits.float(), batch["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if step % 50 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())

        val = evaluate(model.module, val_loader, device, len(ds["validation"]), world_size)
        logger.info("epoch %d val %s", epoch, val)
        if val["macro_f1"] > best:
            best, bad = val["macro_f1"], 0
            if rank == 0:
                torch.save(model.module.state_dict(), best_path)
        else:
            bad += 1
        dist.barrier()
        if bad >= args.patience:
            logger.info("early stop after epoch %d", epoch)
            break

    # reload the best weights on every rank for the test pass
    model.module.load_state_dict(torch.load(best_path, map_location=device))
    test = evaluate(model.module, test_loader, device, len(ds["test"]), world_size)
    logger.info("test %s", test)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
