"""Invoice field extraction (vendor, invoice no., dates, totals, IBAN ...) with LiLT.

Long invoices are split into overlapping 512-token windows. Most windows of multi-page invoices
are line items with no header fields at all.

    torchrun --nproc_per_node=4 15_lilt_invoice_kie.py --train data/invoices_train.jsonl --dev data/invoices_dev.jsonl
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, LiltForTokenClassification, get_linear_schedule_with_warmup

FIELDS = ["VENDOR", "INVOICE_NO", "INVOICE_DATE", "DUE_DATE", "NET", "VAT", "TOTAL", "IBAN", "CURRENCY"]
LABELS = ["O"] + [f"{p}-{f}" for f in FIELDS for p in ("B", "I")]
L2I = {l: i for i, l in enumerate(LABELS)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--model", default="SCUT-DLVCLab/lilt-roberta-en-base")
    ap.add_argument("--out", default="models/lilt_invoices")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def normalize_box(box, w, h):
    x0, y0, x1, y1 = box
    return [max(0, min(1000, int(1000 * v / s))) for v, s in ((x0, w), (y0, h), (x1, w), (y1, h))]


class InvoiceWindows(Dataset):
    """Tokenizes every page once and cuts it into windows of at most `window` tokens."""

    def __init__(self, path, tokenizer, window, stride):
        self.items = []
        with open(path) as f:
            pages = [json.loads(l) for l in f]
        for page_idx, page in enumerate(pages):
            boxes = [normalize_box(b, page["page_w"], page["page_h"]) for b in page["boxes"]]
            enc = tokenizer(page["words"], is_split_into_words=True, truncation=True, max_length=window,
                            stride=stride, return_overflowing_tokens=True, padding="max_length")
            for w in range(len(enc["input_ids"])):
                word_ids = enc.word_ids(w)
                tok_boxes, tok_labels, prev = [], [], None
                for wid in word_ids:
                    if wid is None:
                        tok_boxes.append([0, 0, 0, 0])
                        tok_labels.append(-100)
                    else:
                        tok_boxes.append(boxes[wid])
                        tok_labels.append(L2I[page["labels"][wid]] if wid != prev else -100)
                    prev = wid
                self.items.append({
                    "input_ids": torch.tensor(enc["input_ids"][w]),
                    "attention_mask": torch.tensor(enc["attention_mask"][w]),
                    "bbox": torch.tensor(tok_boxes),
                    "labels": torch.tensor(tok_labels),
                    "page": torch.tensor(page_idx),
                })

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    local = []
    for batch in loader:
        logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                       bbox=batch["bbox"].to(device)).logits
        pred = logits.argmax(-1).cpu()
        for p, l in zip(pred, batch["labels"]):
            keep = l != -100
            local.append(([LABELS[i] for i in l[keep].tolist()], [LABELS[i] for i in p[keep].tolist()]))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    model.train()
    y_true = [t for part in parts for t, _ in part]
    y_pred = [p for part in parts for _, p in part]
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=3)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model, add_prefix_space=True)
    train_ds = InvoiceWindows(args.train, tokenizer, args.window, args.stride)
    dev_ds = InvoiceWindows(args.dev, tokenizer, args.window, args.stride)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=2, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=32, sampler=DistributedSampler(dev_ds, shuffle=False))
    if rank == 0:
        print(f"{len(train_ds)} train windows, {len(dev_ds)} dev windows", flush=True)

    model = LiltForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id=L2I
    ).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, total // 10, total)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        n_steps, loss_sum = 0, 0.0
        for batch in train_loader:
            labels = batch["labels"]
            # windows with only line items carry no field tokens; training on them just pushes everything to O
            if not ((labels > 0) & (labels != -100)).any():
                continue
            out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                        bbox=batch["bbox"].to(device), labels=labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_sum += out.loss.item()
            n_steps += 1

        f1, report = evaluate(model, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: {n_steps} updates, loss {loss_sum / max(n_steps, 1):.4f}, dev F1 {f1:.4f}",
                  flush=True)
            if f1 > best:
                best = f1
                print(report, flush=True)
                model.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
