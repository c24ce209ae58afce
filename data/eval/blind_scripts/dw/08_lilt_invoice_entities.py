#!/usr/bin/env python
"""LiLT entity tagging for vendor invoices (header fields + line-item cells).

The annotation team keeps adding field types, so the tag set is read from the training
export instead of being hard-coded here.

Launch:
    torchrun --nproc_per_node=8 08_lilt_invoice_entities.py \
        --train /mnt/docai/invoices/ann/train.jsonl --valid /mnt/docai/invoices/ann/valid.jsonl \
        --save_dir /mnt/docai/models/lilt_invoices
"""
import argparse
import json
import logging
import math
import os

import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3TokenizerFast, LiltForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def read_jsonl(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(l) for l in fh if l.strip()]


class InvoiceTokens(Dataset):
    """Each record: {"words": [...], "bboxes": [[x0,y0,x1,y1] in 0-1000], "tags": [...]}"""

    def __init__(self, records, tokenizer, label2id, max_length):
        self.records = records
        self.tok = tokenizer
        self.label2id = label2id
        self.max_length = max_length

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        enc = self.tok(
            r["words"], boxes=r["bboxes"], word_labels=[self.label2id[t] for t in r["tags"]],
            truncation=True, max_length=self.max_length, padding="max_length", return_tensors="pt",
        )
        return {k: v.squeeze(0) for k, v in enc.items()}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--model", default="SCUT-DLVCLab/lilt-roberta-en-base")
    ap.add_argument("--max_length", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--log_every", type=int, default=50)
    return ap.parse_args()


@torch.no_grad()
def predict(model, loader, id2label, device):
    model.eval()
    out = []
    for batch in loader:
        labels = batch.pop("labels")
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = model(**batch).logits.argmax(-1).cpu()
        for p_row, l_row in zip(preds.tolist(), labels.tolist()):
            pairs = [(id2label[l], id2label[p]) for p, l in zip(p_row, l_row) if l != -100]
            out.append(([t for t, _ in pairs], [p for _, p in pairs]))
    model.train()
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(levelname)s - %(message)s")

    train_records = read_jsonl(args.train)
    valid_records = read_jsonl(args.valid)
    entity_tags = {t for r in train_records for t in r["tags"] if t != "O"}
    label_list = ["O"] + list(entity_tags)
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}
    # tags seen only in validation are mapped to O
    for r in valid_records:
        r["tags"] = [t if t in label2id else "O" for t in r["tags"]]
    logger.info("%d labels: %s", len(label_list), label_list)

    tokenizer = LayoutLMv3TokenizerFast.from_pretrained(args.model)
    train_ds = InvoiceTokens(train_records, tokenizer, label2id, args.max_length)
    valid_ds = InvoiceTokens(valid_records, tokenizer, label2id, args.max_length)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)),
                              batch_size=32, num_workers=2)

    model = LiltForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_list), id2label=id2label, label2id=label2id
    )
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * steps), steps)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % args.log_every == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        local = predict(model.module, valid_loader, id2label, device)
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        if rank == 0:
            y_true = [t for part in gathered for t, _ in part]
            y_pred = [p for part in gathered for _, p in part]
            f1 = f1_score(y_true, y_pred)
            logger.info("epoch %d valid entity F1 %.4f", epoch, f1)
            if f1 > best:
                best = f1
                model.module.save_pretrained(args.save_dir)
                tokenizer.save_pretrained(args.save_dir)
                with open(os.path.join(args.save_dir, "valid_report.txt"), "w") as fh:
                    fh.write(classification_report(y_true, y_pred, digits=4))
        dist.barrier()

    if rank == 0:
        logger.info("done, best valid F1 %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
