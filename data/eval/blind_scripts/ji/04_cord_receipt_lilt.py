"""Key information extraction on CORD-v2 receipts with LiLT (text + layout, no image).

Each receipt has a different number of OCR words, so batches are padded dynamically.

    torchrun --nproc_per_node=4 04_cord_receipt_lilt.py --out runs/cord_lilt
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, DataCollatorForTokenClassification,
                          LayoutLMv3TokenizerFast, get_cosine_schedule_with_warmup)

CORD_CATEGORIES = [
    "menu.cnt", "menu.discountprice", "menu.etc", "menu.itemsubtotal", "menu.nm", "menu.num",
    "menu.price", "menu.sub_cnt", "menu.sub_etc", "menu.sub_nm", "menu.sub_price", "menu.sub_unitprice",
    "menu.unitprice", "menu.vatyn", "sub_total.discount_price", "sub_total.etc", "sub_total.othersvc_price",
    "sub_total.service_price", "sub_total.subtotal_price", "sub_total.tax_price", "total.cashprice",
    "total.changeprice", "total.creditcardprice", "total.emoneyprice", "total.menuqty_cnt",
    "total.menutype_cnt", "total.total_etc", "total.total_price", "void_menu.nm", "void_menu.price",
]
LABELS = ["O"] + [f"{p}-{c.upper()}" for c in CORD_CATEGORIES for p in ("B", "I")]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SCUT-DLVCLab/lilt-roberta-en-base")
    ap.add_argument("--out", default="runs/cord")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=float, default=0.06)
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def quad_to_box(quad, w, h):
    xs = [quad["x1"], quad["x2"], quad["x3"], quad["x4"]]
    ys = [quad["y1"], quad["y2"], quad["y3"], quad["y4"]]
    box = [min(xs) / w, min(ys) / h, max(xs) / w, max(ys) / h]
    return [int(max(0, min(1000, round(v * 1000)))) for v in box]


def receipt_to_words(example):
    gt = json.loads(example["ground_truth"])
    w, h = gt["meta"]["image_size"]["width"], gt["meta"]["image_size"]["height"]
    words, boxes, tags = [], [], []
    for line in gt["valid_line"]:
        cat = line["category"].upper()
        for j, word in enumerate(line["words"]):
            if not word["text"].strip():
                continue
            words.append(word["text"])
            boxes.append(quad_to_box(word["quad"], w, h))
            tag = ("B-" if j == 0 else "I-") + cat
            tags.append(LABEL2ID.get(tag, 0))
    return {"words": words, "boxes": boxes, "tags": tags}


def make_encoder(tokenizer, max_len):
    def encode(ex):
        enc = tokenizer(ex["words"], boxes=ex["boxes"], truncation=True, max_length=max_len)
        word_ids = enc.word_ids()
        labels, prev = [], None
        for wid in word_ids:
            if wid is None or wid == prev:
                labels.append(-100)
            else:
                labels.append(ex["tags"][wid])
            prev = wid
        enc["labels"] = labels
        return enc
    return encode


@torch.no_grad()
def evaluate(model, loader, device, n_examples, world):
    model.eval()
    preds_list, labels_list = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], bbox=batch["bbox"],
                       attention_mask=batch["attention_mask"]).logits
        preds_list.append(logits.argmax(-1))
        labels_list.append(batch["labels"])

    max_len = max(p.size(1) for p in preds_list)
    preds = torch.cat([F.pad(p, (0, max_len - p.size(1)), value=-100) for p in preds_list])
    labels = torch.cat([F.pad(l, (0, max_len - l.size(1)), value=-100) for l in labels_list])

    g_preds = [torch.zeros_like(preds) for _ in range(world)]
    g_labels = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(g_preds, preds)
    dist.all_gather(g_labels, labels)
    model.train()

    if dist.get_rank() != 0:
        return None
    # DistributedSampler(shuffle=False) deals indices round-robin: interleave to restore order
    preds = torch.stack(g_preds, 1).flatten(0, 1)[:n_examples].cpu().tolist()
    labels = torch.stack(g_labels, 1).flatten(0, 1)[:n_examples].cpu().tolist()
    y_true, y_pred = [], []
    for p_row, l_row in zip(preds, labels):
        y_true.append([LABELS[l] for l in l_row if l != -100])
        y_pred.append([LABELS[p] for p, l in zip(p_row, l_row) if l != -100])
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=4)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # LiLT reuses the RoBERTa vocab; the LayoutLMv3 fast tokenizer handles the word boxes
    tokenizer = LayoutLMv3TokenizerFast.from_pretrained(args.model)
    raw = load_dataset("naver-clova-ix/cord-v2")
    encode = make_encoder(tokenizer, args.max_len)
    splits = {}
    for split in ("train", "validation", "test"):
        ds = raw[split].map(receipt_to_words, remove_columns=raw[split].column_names,
                            load_from_cache_file=False, keep_in_memory=True)
        splits[split] = ds.map(encode, remove_columns=ds.column_names,
                               load_from_cache_file=False, keep_in_memory=True)

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(splits["train"], shuffle=True, seed=args.seed)
    train_dl = DataLoader(splits["train"], batch_size=args.bs, sampler=train_sampler,
                          collate_fn=collator, num_workers=2, drop_last=True)

    def eval_loader(name):
        sampler = DistributedSampler(splits[name], shuffle=False)
        return DataLoader(splits[name], batch_size=args.bs, sampler=sampler, collate_fn=collator, num_workers=2)

    val_dl, test_dl = eval_loader("validation"), eval_loader("test")

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id=LABEL2ID
    ).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(args.warmup * total), total)

    os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tot_loss = torch.zeros((), device=device)
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            tot_loss += loss.detach()
        dist.all_reduce(tot_loss, op=dist.ReduceOp.AVG)

        res = evaluate(model, val_dl, device, len(splits["validation"]), world)
        if rank == 0:
            f1, _ = res
            print(f"epoch {epoch} train_loss {tot_loss.item() / len(train_dl):.4f} val_f1 {f1:.4f}", flush=True)
            if f1 > best:
                best = f1
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.bin"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.bin"), map_location=device))
    res = evaluate(model, test_dl, device, len(splits["test"]), world)
    if rank == 0:
        f1, report = res
        print(f"test entity F1 {f1:.4f}\n{report}")
        with open(os.path.join(args.out, "test_report.txt"), "w") as fh:
            fh.write(report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
