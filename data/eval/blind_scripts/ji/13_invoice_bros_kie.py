"""Invoice field extraction (vendor, invoice no., dates, amounts, ...) with BROS.

Annotations were exported from Label Studio and flattened to one json per page:
    {"words": [...], "boxes": [[x0, y0, x1, y1], ...] (pixels), "width": W, "height": H, "tags": ["B-TOTAL", ...]}

    torchrun --nproc_per_node=4 13_invoice_bros_kie.py --data /data/invoices_kie
"""
import argparse
import glob
import json
import os
import random
from collections import Counter

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, BrosForTokenClassification, get_linear_schedule_with_warmup

FIELDS = ["VENDOR", "VENDOR_ADDR", "INVOICE_NO", "INVOICE_DATE", "DUE_DATE", "PO_NUMBER",
          "SUBTOTAL", "TAX", "TOTAL", "CURRENCY", "IBAN"]
TAGS = ["O"] + [f"{p}-{f}" for f in FIELDS for p in ("B", "I")]
TAG2ID = {t: i for i, t in enumerate(TAGS)}


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="naver-clova-ocr/bros-base-uncased")
    ap.add_argument("--out", default="outputs/invoice_bros")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--max_len", type=int, default=512)
    return ap.parse_args()


class InvoicePages(Dataset):
    def __init__(self, files, tokenizer, max_len):
        self.files = files
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i]) as f:
            page = json.load(f)
        w, h = float(page["width"]), float(page["height"])
        enc = self.tok(page["words"], is_split_into_words=True, truncation=True,
                       max_length=self.max_len, padding="max_length")
        boxes, labels, prev = [], [], None
        for wid in enc.word_ids():
            if wid is None:
                boxes.append([0.0, 0.0, 0.0, 0.0])
                labels.append(-100)
            else:
                x0, y0, x1, y1 = page["boxes"][wid]
                boxes.append([x0 / w, y0 / h, x1 / w, y1 / h])
                labels.append(TAG2ID.get(page["tags"][wid], 0) if wid != prev else -100)
            prev = wid
        return {"input_ids": torch.tensor(enc["input_ids"]),
                "attention_mask": torch.tensor(enc["attention_mask"]),
                "bbox": torch.tensor(boxes).clamp(0, 1),
                "labels": torch.tensor(labels)}


def extract_entities(seq):
    ents, cur = [], None
    for i, tag in enumerate(seq):
        if tag.startswith("B-") or (tag.startswith("I-") and (cur is None or cur[0] != tag[2:])):
            if cur:
                ents.append(tuple(cur))
            cur = [tag[2:], i, i]
        elif tag.startswith("I-"):
            cur[2] = i
        else:
            if cur:
                ents.append(tuple(cur))
            cur = None
    if cur:
        ents.append(tuple(cur))
    return ents


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tp, fp, fn = Counter(), Counter(), Counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], bbox=batch["bbox"],
                       attention_mask=batch["attention_mask"]).logits
        for p_row, l_row in zip(logits.argmax(-1).tolist(), batch["labels"].tolist()):
            gold = set(extract_entities([TAGS[l] for l in l_row if l != -100]))
            pred = set(extract_entities([TAGS[p] for p, l in zip(p_row, l_row) if l != -100]))
            for e in gold & pred:
                tp[e[0]] += 1
            for e in pred - gold:
                fp[e[0]] += 1
            for e in gold - pred:
                fn[e[0]] += 1
    stats = torch.tensor([[tp[f], fp[f], fn[f]] for f in FIELDS], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    per_field = {}
    for f, (t, p, n) in zip(FIELDS, stats.tolist()):
        per_field[f] = 2 * t / max(2 * t + p + n, 1)
    t, p, n = stats.sum(0).tolist()
    return 2 * t / max(2 * t + p + n, 1), per_field


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.data, "pages", "*.json")))
    with open(os.path.join(args.data, "test_ids.txt")) as f:
        test_ids = {ln.strip() for ln in f if ln.strip()}
    test_files = [p for p in files if os.path.basename(p)[:-5] in test_ids]
    train_files = [p for p in files if os.path.basename(p)[:-5] not in test_ids]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = InvoicePages(train_files, tokenizer, args.max_len)
    test_ds = InvoicePages(test_files, tokenizer, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, drop_last=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                         batch_size=args.bs, num_workers=4)

    model = BrosForTokenClassification.from_pretrained(args.model, num_labels=len(TAGS)).to(device)
    model.bros.pooler.requires_grad_(False)  # pooled output is not used for tagging
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    n_updates = args.epochs * len(train_dl) // args.accum
    scheduler = get_linear_schedule_with_warmup(optimizer, n_updates // 10, n_updates)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_files)} train / {len(test_files)} test pages on {world} GPUs", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync_now = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not sync_now else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.accum
                loss.backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

        f1, per_field = evaluate(model.module, test_dl, device)
        if rank == 0:
            fields = " ".join(f"{k}={v:.3f}" for k, v in per_field.items())
            print(f"epoch {epoch}: loss {loss.item() * args.accum:.4f} micro-F1 {f1:.4f} | {fields}", flush=True)
            if f1 > best:
                best = f1
                model.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
        dist.barrier()

    if rank == 0:
        print(f"best micro-F1 {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
