"""Multilingual receipt field tagging (DE/FR/ES/IT/PL) with LiLT + XLM-RoBERTa.

Pages come from the EU expense-report pipeline; words/boxes are from our OCR service,
boxes already scaled to 0..1000. A fair share of pages are card slips or torn receipts
with no labelled field at all.

    torchrun --nproc_per_node=4 14_lilt_xlm_multilingual_receipts.py \
        --train_dir /data/expenses/kie/train --eval_dir /data/expenses/kie/eval --out /data/expenses/models/lilt_xlm
"""
import argparse
import glob
import json
import logging
import os

import torch
import torch.distributed as dist
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutXLMTokenizerFast, LiltForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger("lilt_xlm")

TAGS = ["O", "B-MERCHANT", "I-MERCHANT", "B-DATE", "I-DATE", "B-TIME", "I-TIME", "B-TOTAL", "I-TOTAL",
        "B-VAT", "I-VAT", "B-VAT_RATE", "I-VAT_RATE", "B-CURRENCY", "I-CURRENCY"]
TAG2ID = {t: i for i, t in enumerate(TAGS)}


class ReceiptJsonDir(Dataset):
    def __init__(self, folder, tokenizer, max_length=512):
        self.files = sorted(glob.glob(os.path.join(folder, "*.json")))
        self.tok = tokenizer
        self.max_length = max_length

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], encoding="utf-8") as fh:
            page = json.load(fh)
        enc = self.tok(
            page["words"], boxes=page["boxes"], word_labels=[TAG2ID.get(t, 0) for t in page["tags"]],
            truncation=True, padding="max_length", max_length=self.max_length, return_tensors="pt",
        )
        return {k: v[0] for k, v in enc.items()}


def decode_tags(pred, gold):
    y_true, y_pred = [], []
    for p_row, g_row in zip(pred.tolist(), gold.tolist()):
        keep = [(TAGS[g], TAGS[p]) for p, g in zip(p_row, g_row) if g != -100]
        y_true.append([g for g, _ in keep])
        y_pred.append([p for _, p in keep])
    return y_true, y_pred


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], bbox=batch["bbox"],
                       attention_mask=batch["attention_mask"]).logits
        t, p = decode_tags(logits.argmax(-1).cpu(), batch["labels"].cpu())
        y_true += t
        y_pred += p
    model.train()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (y_true, y_pred))
    y_true = [s for t, _ in parts for s in t]
    y_pred = [s for _, p in parts for s in p]
    return {"p": precision_score(y_true, y_pred), "r": recall_score(y_true, y_pred), "f1": f1_score(y_true, y_pred)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--eval_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="nielsr/lilt-xlm-roberta-base")
    ap.add_argument("--tokenizer", default="microsoft/layoutxlm-base")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--grad_accum", type=int, default=2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tok = LayoutXLMTokenizerFast.from_pretrained(args.tokenizer)
    train_ds = ReceiptJsonDir(args.train_dir, tok)
    eval_ds = ReceiptJsonDir(args.eval_dir, tok)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=3)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    eval_dl = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world)), batch_size=32, num_workers=4)

    model = LiltForTokenClassification.from_pretrained(
        args.model, num_labels=len(TAGS), id2label=dict(enumerate(TAGS)), label2id=TAG2ID
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates = args.epochs * len(train_dl) // args.grad_accum
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * updates), updates)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if (batch["labels"] > 0).sum() == 0:
                continue  # only background on these pages
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / args.grad_accum
            loss.backward()
            if (i + 1) % args.grad_accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and i % 100 == 0:
                logger.info("epoch %d it %d loss %.4f", epoch, i, loss.item() * args.grad_accum)

        scores = evaluate(model.module, eval_dl, device)
        if rank == 0:
            logger.info("epoch %d eval P %.4f R %.4f F1 %.4f", epoch, scores["p"], scores["r"], scores["f1"])
            if scores["f1"] > best_f1:
                best_f1 = scores["f1"]
                model.module.save_pretrained(args.out)
                tok.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
