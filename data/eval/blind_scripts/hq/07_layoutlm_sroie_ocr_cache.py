"""Key information extraction on SROIE receipts (company / date / address / total) with LayoutLM.

Receipts are OCR'd with tesseract once and the encoded features are cached next to the data,
because OCR of the 626 training receipts takes ~15 minutes.

    torchrun --nproc_per_node=4 07_layoutlm_sroie_ocr_cache.py --data_dir /data/sroie --epochs 40
"""
import argparse
import glob
import json
import os
import re

import pytesseract
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMForTokenClassification, LayoutLMTokenizerFast, get_linear_schedule_with_warmup

FIELDS = ["company", "date", "address", "total"]
LABELS = ["O"] + [f"{p}-{f.upper()}" for f in FIELDS for p in ("B", "I")]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True, help="has train/{img,key} and test/{img,key}")
    ap.add_argument("--model", default="microsoft/layoutlm-base-uncased")
    ap.add_argument("--output_dir", default="output/layoutlm_sroie")
    ap.add_argument("--max_seq_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def norm(s):
    return re.sub(r"[^0-9a-z]", "", s.lower())


def ocr_words(path):
    img = Image.open(path).convert("RGB")
    w, h = img.size
    data = pytesseract.image_to_data(img, output_type=pytesseract.Output.DICT)
    words, boxes = [], []
    for txt, x, y, bw, bh, conf in zip(data["text"], data["left"], data["top"],
                                       data["width"], data["height"], data["conf"]):
        if not txt.strip() or float(conf) < 0:
            continue
        words.append(txt)
        boxes.append([int(1000 * x / w), int(1000 * y / h), int(1000 * (x + bw) / w), int(1000 * (y + bh) / h)])
    return words, boxes


def tag_words(words, key):
    """Weak labels: mark OCR words whose text appears inside a key field value."""
    tags = ["O"] * len(words)
    for field in FIELDS:
        value = key.get(field, "")
        if not value:
            continue
        value_n = norm(value)
        started = False
        for i, w in enumerate(words):
            wn = norm(w)
            if wn and wn in value_n and tags[i] == "O":
                tags[i] = ("I-" if started else "B-") + field.upper()
                started = True
            elif started:
                started = False
    return tags


def encode_split(split_dir, tokenizer, max_len):
    all_ids, all_boxes, all_mask, all_labels = [], [], [], []
    for img_path in sorted(glob.glob(os.path.join(split_dir, "img", "*.jpg"))):
        stem = os.path.splitext(os.path.basename(img_path))[0]
        with open(os.path.join(split_dir, "key", stem + ".json")) as f:
            key = json.load(f)
        words, boxes = ocr_words(img_path)
        tags = tag_words(words, key)
        enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len,
                        padding="max_length")
        tok_boxes, tok_labels, prev = [], [], None
        for wid in enc.word_ids():
            if wid is None:
                tok_boxes.append([0, 0, 0, 0])
                tok_labels.append(-100)
            else:
                tok_boxes.append(boxes[wid])
                tok_labels.append(LABEL2ID[tags[wid]] if wid != prev else -100)
            prev = wid
        all_ids.append(enc["input_ids"])
        all_mask.append(enc["attention_mask"])
        all_boxes.append(tok_boxes)
        all_labels.append(tok_labels)
    return {
        "input_ids": torch.tensor(all_ids),
        "bbox": torch.tensor(all_boxes),
        "attention_mask": torch.tensor(all_mask),
        "labels": torch.tensor(all_labels),
    }


def load_or_build(split, args, tokenizer):
    cache_file = os.path.join(args.data_dir, f"cached_{split}_{args.max_seq_len}.pt")
    if os.path.exists(cache_file):
        feats = torch.load(cache_file)
    else:
        feats = encode_split(os.path.join(args.data_dir, split), tokenizer, args.max_seq_len)
        torch.save(feats, cache_file)
    return TensorDataset(feats["input_ids"], feats["bbox"], feats["attention_mask"], feats["labels"])


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct, predicted entities, gold entities (token level)
    for ids, bbox, mask, labels in loader:
        ids, bbox, mask, labels = ids.to(device), bbox.to(device), mask.to(device), labels.to(device)
        pred = model(input_ids=ids, bbox=bbox, attention_mask=mask).logits.argmax(-1)
        valid = labels != -100
        stats[0] += ((pred == labels) & valid & (labels != 0)).sum()
        stats[1] += ((pred != 0) & valid).sum()
        stats[2] += ((labels != 0) & valid).sum()
    dist.all_reduce(stats)
    model.train()
    p = (stats[0] / stats[1].clamp(min=1)).item()
    r = (stats[0] / stats[2].clamp(min=1)).item()
    return p, r, 2 * p * r / max(p + r, 1e-8)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = LayoutLMTokenizerFast.from_pretrained(args.model)
    train_ds = load_or_build("train", args, tokenizer)
    test_ds = load_or_build("test", args, tokenizer)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2)
    test_loader = DataLoader(test_ds, batch_size=16, sampler=DistributedSampler(test_ds, shuffle=False))

    model = LayoutLMForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id=LABEL2ID,
    ).to(device)
    # LayoutLMModel always builds its pooler, which token classification never uses
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        epoch_loss = 0.0
        for ids, bbox, mask, labels in train_loader:
            out = model(input_ids=ids.to(device), bbox=bbox.to(device),
                        attention_mask=mask.to(device), labels=labels.to(device))
            optimizer.zero_grad()
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            epoch_loss += out.loss.item()
        p, r, f1 = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {epoch_loss / len(train_loader):.4f} "
                  f"P {p:.4f} R {r:.4f} F1 {f1:.4f}", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
