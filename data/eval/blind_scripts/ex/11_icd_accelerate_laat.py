"""
ICD-10-CM coding of discharge summaries with a clinical PLM + label-wise attention, trained with
HF Accelerate (multi-GPU DDP, bf16, gradient accumulation, W&B tracking).

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        11_icd_accelerate_laat.py --data_dir data/mimic4_icd10_top50 --output_dir runs/acc_laat
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from sklearn.metrics import f1_score, roc_auc_score
from torch.utils.data import DataLoader
from transformers import AutoModel, AutoTokenizer, get_scheduler

logger = get_logger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--model_name", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--chunk_len", type=int, default=512)
    ap.add_argument("--num_chunks", type=int, default=6)
    ap.add_argument("--per_device_batch_size", type=int, default=2)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--warmup_ratio", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--resume_from", default=None)
    ap.add_argument("--with_tracking", action="store_true")
    return ap.parse_args()


class ChunkLAAT(nn.Module):
    def __init__(self, name, num_labels, att_dim=512):
        super().__init__()
        self.plm = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.plm.config.hidden_size
        self.W = nn.Linear(h, att_dim, bias=False)
        self.U = nn.Linear(att_dim, num_labels, bias=False)
        self.out = nn.Linear(h, num_labels)

    def forward(self, input_ids, attention_mask):
        b, c, t = input_ids.shape
        h = self.plm(input_ids=input_ids.view(b * c, t), attention_mask=attention_mask.view(b * c, t)).last_hidden_state
        h = h.reshape(b, c * t, -1)
        a = self.U(torch.tanh(self.W(h))).transpose(1, 2)
        a = a.masked_fill(attention_mask.view(b, 1, c * t) == 0, torch.finfo(a.dtype).min)
        v = torch.softmax(a, dim=-1) @ h
        return (self.out.weight * v).sum(-1) + self.out.bias


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="wandb" if args.with_tracking else None)
    set_seed(args.seed)

    with open(os.path.join(args.data_dir, "labels.txt")) as f:
        labels = [l.strip() for l in f if l.strip()]
    label2id = {l: i for i, l in enumerate(labels)}
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    raw = load_dataset("csv", data_files={"train": os.path.join(args.data_dir, "train.csv"),
                                          "validation": os.path.join(args.data_dir, "dev.csv")})
    max_tokens = args.chunk_len * args.num_chunks

    def preprocess(batch):
        enc = tokenizer(batch["text"], truncation=True, max_length=max_tokens, padding="max_length")
        ys = []
        for codes in batch["codes"]:
            y = [0.0] * len(labels)
            for c in (codes or "").split(";"):
                if c in label2id:
                    y[label2id[c]] = 1.0
            ys.append(y)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": ys}

    with accelerator.main_process_first():
        ds = raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names,
                     desc="tokenising notes", num_proc=8)
    ds.set_format("torch")

    def collate(rows):
        ids = torch.stack([r["input_ids"] for r in rows]).view(len(rows), args.num_chunks, args.chunk_len)
        mask = torch.stack([r["attention_mask"] for r in rows]).view(len(rows), args.num_chunks, args.chunk_len)
        return ids, mask, torch.stack([r["labels"] for r in rows]).float()

    train_dl = DataLoader(ds["train"], batch_size=args.per_device_batch_size, shuffle=True, collate_fn=collate,
                          num_workers=4, drop_last=True)
    eval_dl = DataLoader(ds["validation"], batch_size=args.per_device_batch_size * 4, collate_fn=collate,
                         num_workers=4)

    model = ChunkLAAT(args.model_name, len(labels))
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(x in n for x in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(x in n for x in no_decay)], "weight_decay": 0.0},
    ], lr=args.lr)

    # prepare() shards the loaders, so the step count is computed afterwards from the per-process length
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    updates_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_updates = updates_per_epoch * args.epochs
    # the prepared scheduler is advanced once per process at every optimizer update
    lr_scheduler = get_scheduler("linear", optimizer,
                                 num_warmup_steps=int(args.warmup_ratio * max_updates) * accelerator.num_processes,
                                 num_training_steps=max_updates * accelerator.num_processes)
    lr_scheduler = accelerator.prepare(lr_scheduler)

    if args.with_tracking:
        accelerator.init_trackers("icd10-laat", config=vars(args))

    start_epoch = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        start_epoch = int(os.path.basename(args.resume_from.rstrip("/")).split("_")[-1]) + 1
        accelerator.print(f"resumed from {args.resume_from}, starting at epoch {start_epoch}")

    best = -1.0
    for epoch in range(start_epoch, args.epochs):
        model.train()
        total_loss = 0.0
        for ids, mask, y in train_dl:
            with accelerator.accumulate(model):
                logits = model(ids, mask)
                loss = F.binary_cross_entropy_with_logits(logits.float(), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            total_loss += loss.detach().float()
        mean_loss = accelerator.reduce(total_loss, reduction="mean").item() / len(train_dl)

        model.eval()
        all_probs, all_y = [], []
        for ids, mask, y in eval_dl:
            with torch.no_grad():
                logits = model(ids, mask)
            probs, y = accelerator.gather_for_metrics((torch.sigmoid(logits.float()), y))
            all_probs.append(probs.cpu().numpy())
            all_y.append(y.cpu().numpy())
        probs, golds = np.concatenate(all_probs), np.concatenate(all_y)
        preds = (probs >= 0.5).astype(int)
        micro = f1_score(golds, preds, average="micro", zero_division=0)
        macro = f1_score(golds, preds, average="macro", zero_division=0)
        micro_auc = roc_auc_score(golds, probs, average="micro")
        accelerator.print(f"epoch {epoch}: loss {mean_loss:.4f} micro-F1 {micro:.4f} macro-F1 {macro:.4f} "
                          f"micro-AUC {micro_auc:.4f} (n={len(golds)})")
        if args.with_tracking:
            accelerator.log({"train_loss": mean_loss, "micro_f1": micro, "macro_f1": macro,
                             "micro_auc": micro_auc}, step=epoch)

        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if micro > best:
            best = micro
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            accelerator.save(unwrapped.state_dict(), os.path.join(args.output_dir, "best_model.bin"))
            if accelerator.is_main_process:
                tokenizer.save_pretrained(args.output_dir)

    accelerator.end_training()


if __name__ == "__main__":
    main()
