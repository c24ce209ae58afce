#!/usr/bin/env python
"""
Baseline for the MIMIC-IV ICD-10 top-100 task: fine-tune a clinical RoBERTa as a multi-label sequence
classifier on head+tail truncated discharge notes (first 128 + last 382 tokens, Sun et al. 2019).
Layer-wise learning-rate decay on the encoder.

    torchrun --nproc_per_node=8 19_icd_mimic4_finetune.py --data_dir data/mimic4_top100 --output_dir runs/m4_top100
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


class HeadTailNotes(Dataset):
    def __init__(self, csv_path, tokenizer, code2id, head=128, tail=382):
        df = pd.read_csv(csv_path, usecols=["note_id", "text", "icd_codes"])
        self.ids, self.labels = [], []
        for text, codes in zip(df["text"], df["icd_codes"]):
            toks = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(toks) > head + tail:
                toks = toks[:head] + toks[-tail:]
            self.ids.append([tokenizer.cls_token_id] + toks + [tokenizer.sep_token_id])
            y = np.zeros(len(code2id), dtype=np.float32)
            for c in str(codes).split(";"):
                if c in code2id:
                    y[code2id[c]] = 1.0
            self.labels.append(y)
        self.pad_id = tokenizer.pad_token_id

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.labels[i], i

    def collate(self, batch):
        L = max(len(b[0]) for b in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        for r, (x, _, _) in enumerate(batch):
            ids[r, : len(x)] = torch.tensor(x)
        y = torch.from_numpy(np.stack([b[1] for b in batch]))
        idx = torch.tensor([b[2] for b in batch])
        return ids, (ids != self.pad_id).long(), y, idx


def llrd_param_groups(model, base_lr, decay, weight_decay=0.01):
    n_layers = model.config.num_hidden_layers
    groups = []
    for name, p in model.named_parameters():
        if "classifier" in name:
            lr = base_lr * 5
        elif "encoder.layer." in name:
            layer = int(name.split("encoder.layer.")[1].split(".")[0])
            lr = base_lr * decay ** (n_layers - layer)
        else:  # embeddings
            lr = base_lr * decay ** (n_layers + 1)
        wd = 0.0 if name.endswith("bias") or "LayerNorm" in name else weight_decay
        groups.append({"params": [p], "lr": lr, "weight_decay": wd})
    return groups


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    model.eval()
    chunks = []
    for ids, mask, y, idx in loader:
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        chunks.append((idx.numpy(), torch.sigmoid(logits.float()).cpu().numpy(), y.numpy()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, chunks)
    probs = np.zeros((n_total, chunks[0][1].shape[1]), dtype=np.float32)
    golds = np.zeros_like(probs)
    for rank_chunks in gathered:
        for idx, p, g in rank_chunks:
            probs[idx], golds[idx] = p, g
    pred = (probs >= 0.5).astype(int)
    return {"micro_f1": f1_score(golds, pred, average="micro", zero_division=0),
            "macro_f1": f1_score(golds, pred, average="macro", zero_division=0),
            "micro_auc": roc_auc_score(golds, probs, average="micro"),
            "macro_auc": roc_auc_score(golds, probs, average="macro")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model_name", default="roberta-base-pm-m3-voc")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--llrd", type=float, default=0.9)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    with open(os.path.join(args.data_dir, "top100_codes.json")) as f:
        codes = json.load(f)
    code2id = {c: i for i, c in enumerate(codes)}
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = HeadTailNotes(os.path.join(args.data_dir, "train.csv"), tokenizer, code2id)
    dev_ds = HeadTailNotes(os.path.join(args.data_dir, "dev.csv"), tokenizer, code2id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=train_ds.collate, num_workers=4, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=32, sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=dev_ds.collate, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=len(codes), problem_type="multi_label_classification",
        id2label=dict(enumerate(codes)), label2id=code2id)
    optimizer = torch.optim.AdamW(llrd_param_groups(model, args.lr, args.llrd))
    model = DDP(model.to(device), device_ids=[local_rank])
    total = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        ep_loss = torch.zeros(2, device=device)
        for step, (ids, mask, y, _) in enumerate(train_dl):
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=y.to(device))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            ep_loss += torch.stack([out.loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(ep_loss)

        metrics = evaluate(model.module, dev_dl, device, len(dev_ds))
        logger.info("epoch %d (%.0fs) train loss %.4f | %s", epoch, time.time() - t0,
                    (ep_loss[0] / ep_loss[1]).item(), " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if rank == 0 and metrics["micro_f1"] > best:
            best = metrics["micro_f1"]
            model.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            with open(os.path.join(args.output_dir, "dev_metrics.json"), "w") as f:
                json.dump({"epoch": epoch, **metrics}, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
