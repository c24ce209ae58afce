"""One LayoutLMv3 encoder, two heads: page type classification + form field labelling.

Batches alternate between the two tasks (doc-type pages with OCR, FUNSD-style forms).

    torchrun --nproc_per_node=8 10_multitask_layoutlmv3.py \
        --doc_jsonl /data/doctype/train.jsonl --doc_val_jsonl /data/doctype/val.jsonl --steps 20000
"""
import argparse
import itertools
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LayoutLMv3Model, get_linear_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--backbone", default="microsoft/layoutlmv3-base")
    p.add_argument("--doc_jsonl", required=True)
    p.add_argument("--doc_val_jsonl", required=True)
    p.add_argument("--form_dataset", default="nielsr/funsd-layoutlmv3")
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head_lr", type=float, default=1e-4)
    p.add_argument("--eval_every", type=int, default=2000)
    p.add_argument("--save_dir", default="ckpt/mtl_lmv3")
    return p.parse_args()


class MultiTaskLayoutLM(nn.Module):
    def __init__(self, backbone, num_doc_classes, num_token_labels):
        super().__init__()
        self.encoder = LayoutLMv3Model.from_pretrained(backbone)
        hidden = self.encoder.config.hidden_size
        self.doc_head = nn.Sequential(
            nn.Linear(hidden, hidden), nn.Tanh(), nn.Dropout(0.1), nn.Linear(hidden, num_doc_classes)
        )
        self.token_head = nn.Sequential(nn.Dropout(0.1), nn.Linear(hidden, num_token_labels))

    def forward(self, task, input_ids, bbox, attention_mask, pixel_values, labels=None):
        hidden = self.encoder(
            input_ids=input_ids, bbox=bbox, attention_mask=attention_mask, pixel_values=pixel_values
        ).last_hidden_state
        if task == "doc":
            logits = self.doc_head(hidden[:, 0])
            loss = F.cross_entropy(logits, labels) if labels is not None else None
        else:
            text = hidden[:, : input_ids.size(1)]  # drop the visual patch tokens
            logits = self.token_head(text)
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
        return loss, logits


class DocTypeDataset(Dataset):
    def __init__(self, jsonl, processor, classes):
        with open(jsonl) as f:
            self.recs = [json.loads(l) for l in f]
        self.root = os.path.dirname(jsonl)
        self.processor = processor
        self.class_to_id = {c: i for i, c in enumerate(classes)}

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        r = self.recs[i]
        img = Image.open(os.path.join(self.root, r["image"])).convert("RGB")
        enc = self.processor(img, r["words"], boxes=r["boxes"], truncation=True, padding="max_length",
                             max_length=512, return_tensors="pt")
        item = {k: v[0] for k, v in enc.items()}
        item["labels"] = torch.tensor(self.class_to_id[r["label"]])
        return item


def infinite(loader, sampler):
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


@torch.no_grad()
def evaluate(model, doc_loader, form_loader, device):
    model.eval()
    stats = torch.zeros(5, device=device)  # doc_correct, doc_total, tok_tp, tok_pred, tok_gold
    for batch in doc_loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        _, logits = model("doc", **{k: v for k, v in batch.items() if k != "labels"})
        stats[0] += (logits.argmax(-1) == batch["labels"]).sum()
        stats[1] += batch["labels"].numel()
    for batch in form_loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        _, logits = model("form", **{k: v for k, v in batch.items() if k != "labels"})
        pred, gold = logits.argmax(-1), batch["labels"]
        valid = gold != -100
        stats[2] += ((pred == gold) & valid & (gold != 0)).sum()
        stats[3] += ((pred != 0) & valid).sum()
        stats[4] += ((gold != 0) & valid).sum()
    dist.all_reduce(stats)
    model.train()
    acc = (stats[0] / stats[1]).item()
    p, r = (stats[2] / stats[3].clamp(min=1)).item(), (stats[2] / stats[4].clamp(min=1)).item()
    return acc, 2 * p * r / max(p + r, 1e-8)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    processor = AutoProcessor.from_pretrained(args.backbone, apply_ocr=False)
    with open(args.doc_jsonl) as f:
        classes = sorted({json.loads(l)["label"] for l in f})
    doc_train = DocTypeDataset(args.doc_jsonl, processor, classes)
    doc_val = DocTypeDataset(args.doc_val_jsonl, processor, classes)

    forms = load_dataset(args.form_dataset)
    form_labels = forms["train"].features["ner_tags"].feature.names

    def enc_forms(b):
        return processor(b["image"], b["tokens"], boxes=b["bboxes"], word_labels=b["ner_tags"],
                         truncation=True, padding="max_length", max_length=512)

    if rank != 0:
        dist.barrier()
    form_train = forms["train"].map(enc_forms, batched=True, remove_columns=forms["train"].column_names)
    form_val = forms["test"].map(enc_forms, batched=True, remove_columns=forms["test"].column_names)
    if rank == 0:
        dist.barrier()
    form_train.set_format("torch")
    form_val.set_format("torch")

    samplers = {"doc": DistributedSampler(doc_train), "form": DistributedSampler(form_train)}
    train_iters = {
        "doc": infinite(DataLoader(doc_train, args.batch_size, sampler=samplers["doc"], num_workers=4,
                                   drop_last=True), samplers["doc"]),
        "form": infinite(DataLoader(form_train, args.batch_size, sampler=samplers["form"], num_workers=2,
                                    drop_last=True), samplers["form"]),
    }
    doc_val_loader = DataLoader(doc_val, 16, sampler=DistributedSampler(doc_val, shuffle=False), num_workers=4)
    form_val_loader = DataLoader(form_val, 8, sampler=DistributedSampler(form_val, shuffle=False))

    model = MultiTaskLayoutLM(args.backbone, len(classes), len(form_labels)).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW([
        {"params": model.module.encoder.parameters(), "lr": args.lr},
        {"params": list(model.module.doc_head.parameters()) + list(model.module.token_head.parameters()),
         "lr": args.head_lr},
    ], weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.steps // 20, args.steps)

    best = 0.0
    for step in range(1, args.steps + 1):
        task = "doc" if step % 2 else "form"
        batch = {k: v.to(device, non_blocking=True) for k, v in next(train_iters[task]).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(task, **batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

        if rank == 0 and step % 100 == 0:
            print(f"step {step} [{task}] loss {loss.item():.4f}", flush=True)
        if step % args.eval_every == 0:
            acc, f1 = evaluate(model, doc_val_loader, form_val_loader, device)
            if rank == 0:
                print(f"step {step}: doc acc {acc:.4f} form F1 {f1:.4f}", flush=True)
                score = (acc + f1) / 2
                if score > best:
                    best = score
                    os.makedirs(args.save_dir, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "classes": classes,
                                "form_labels": form_labels, "step": step},
                               os.path.join(args.save_dir, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
