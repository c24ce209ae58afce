"""Pointwise passage reranker: Qwen2-0.5B with a scalar head, trained on (query, passage, label)
triples mined from our search logs. Lightning 2.x DDP, 4 x RTX A6000.

    python 19_lightning_qwen_reranker_gc.py --devices 4 --train data/rerank_train.jsonl --val data/rerank_val.jsonl

Long passages (up to 1024 tokens) -> gradient checkpointing to fit batch 16 per GPU.
"""
import argparse
import os
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding
from transformers import get_linear_schedule_with_warmup

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

TEMPLATE = "Query: {q}\nPassage: {p}\nRelevant:"


def build(tok, path, max_len):
    ds = load_dataset("json", data_files=path, split="train")

    def enc(batch):
        texts = [TEMPLATE.format(q=q, p=p) for q, p in zip(batch["query"], batch["passage"])]
        out = tok(texts, truncation=True, max_length=max_len)
        out["labels"] = [float(l) for l in batch["label"]]
        return out

    keep = ["qid"]
    return ds.map(enc, batched=True, remove_columns=[c for c in ds.column_names if c not in keep])


class Reranker(L.LightningModule):
    def __init__(self, model_name, lr=2e-5, warmup=0.05, pad_id=0):
        super().__init__()
        self.save_hyperparameters()
        self.model = AutoModelForSequenceClassification.from_pretrained(model_name, num_labels=1)
        self.model.config.pad_token_id = pad_id
        self.model.gradient_checkpointing_enable()
        self.val_scores = defaultdict(list)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch["labels"].float())
        self.log("train/bce", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"]).float()
        self.log("val/bce", F.binary_cross_entropy_with_logits(logits, batch["labels"].float()), sync_dist=True)
        for q, s, y in zip(batch["qid"].tolist(), logits.tolist(), batch["labels"].tolist()):
            self.val_scores[q].append((s, y))

    def on_validation_epoch_end(self):
        # MRR@10 on this rank's queries, averaged over ranks weighted by query count
        rr = []
        for q, items in self.val_scores.items():
            ranked = sorted(items, key=lambda t: -t[0])[:10]
            hit = next((i for i, (_, y) in enumerate(ranked) if y > 0.5), None)
            rr.append(0.0 if hit is None else 1.0 / (hit + 1))
        self.val_scores.clear()
        stats = torch.tensor([float(np.sum(rr)), float(len(rr))], device=self.device)
        stats = self.trainer.strategy.reduce(stats, reduce_op="sum")
        self.log("val/mrr10", stats[0] / stats[1].clamp(min=1), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.trainer.estimated_stepping_batches
        sched = get_linear_schedule_with_warmup(opt, int(self.hparams.warmup * total), total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GroupedVal(torch.utils.data.Sampler):
    """all passages of a query go to the same rank so MRR can be computed locally"""

    def __init__(self, qids, rank, world):
        order = sorted(set(qids))
        mine = set(order[rank::world])
        self.idx = [i for i, q in enumerate(qids) if q in mine]

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


class RerankData(L.LightningDataModule):
    def __init__(self, tok, train_path, val_path, max_len, bs):
        super().__init__()
        self.tok, self.train_path, self.val_path = tok, train_path, val_path
        self.max_len, self.bs = max_len, bs
        self.collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)

    def prepare_data(self):
        build(self.tok, self.train_path, self.max_len)
        build(self.tok, self.val_path, self.max_len)

    def setup(self, stage=None):
        self.train_ds = build(self.tok, self.train_path, self.max_len).remove_columns(["qid"])
        self.val_ds = build(self.tok, self.val_path, self.max_len)

    def train_dataloader(self):
        sampler = torch.utils.data.DistributedSampler(self.train_ds, num_replicas=self.trainer.world_size,
                                                      rank=self.trainer.global_rank, shuffle=True, seed=5)
        return DataLoader(self.train_ds, batch_size=self.bs, sampler=sampler, collate_fn=self.collate,
                          num_workers=4, drop_last=True)

    def val_dataloader(self):
        sampler = GroupedVal(self.val_ds["qid"], self.trainer.global_rank, self.trainer.world_size)
        return DataLoader(self.val_ds, batch_size=32, sampler=sampler, collate_fn=self.collate, num_workers=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2-0.5B")
    ap.add_argument("--train", default="data/rerank_train.jsonl")
    ap.add_argument("--val", default="data/rerank_val.jsonl")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--out", default="runs/qwen_reranker")
    args = ap.parse_args()

    L.seed_everything(5)
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = Reranker(args.model, lr=args.lr, pad_id=tok.pad_token_id)

    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp_find_unused_parameters_true",
        precision="bf16-mixed",
        max_epochs=args.epochs,
        val_check_interval=0.5,
        use_distributed_sampler=False,
        logger=TensorBoardLogger(args.out),
        callbacks=[ModelCheckpoint(monitor="val/mrr10", mode="max", save_top_k=1, save_weights_only=True)],
    )

    dm = RerankData(tok, args.train, args.val, args.max_len, args.bs)
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
