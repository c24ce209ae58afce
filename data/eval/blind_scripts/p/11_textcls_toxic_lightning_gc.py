"""Multi-label toxic comment classification (6 labels) with a large encoder.

bert-large at 512 tokens doesn't fit in 40GB at bs=16 without activation
checkpointing, hence --grad-ckpt.

    python 11_textcls_toxic_lightning_gc.py --csv data/jigsaw_train.csv --devices 8 --grad-ckpt
"""
import argparse
import os

import pandas as pd
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MultilabelAUROC
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

LABELS = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]


class CommentDataset(Dataset):
    def __init__(self, texts, labels, tokenizer, max_len):
        self.texts = texts
        self.labels = labels
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_len)
        enc["labels"] = self.labels[i]
        return enc


class Collator:
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def __call__(self, batch):
        labels = torch.tensor([b.pop("labels") for b in batch], dtype=torch.float32)
        enc = self.tok.pad(batch, return_tensors="pt", pad_to_multiple_of=8)
        enc["labels"] = labels
        return enc


class JigsawDM(pl.LightningDataModule):
    def __init__(self, csv, model_name, max_len=512, bs=16, workers=4):
        super().__init__()
        self.csv, self.model_name, self.max_len, self.bs, self.workers = csv, model_name, max_len, bs, workers

    def setup(self, stage=None):
        tok = AutoTokenizer.from_pretrained(self.model_name)
        df = pd.read_csv(self.csv)
        tr, va = train_test_split(df, test_size=0.05, random_state=0)
        self.collate = Collator(tok)
        self.train_ds = CommentDataset(tr["comment_text"].tolist(), tr[LABELS].values.tolist(), tok, self.max_len)
        self.val_ds = CommentDataset(va["comment_text"].tolist(), va[LABELS].values.tolist(), tok, self.max_len)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.bs, shuffle=True, num_workers=self.workers,
                          collate_fn=self.collate, pin_memory=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.bs * 2, num_workers=self.workers,
                          collate_fn=self.collate, pin_memory=True)


class ToxicClassifier(pl.LightningModule):
    def __init__(self, model_name="bert-large-uncased", lr=1.5e-5, warmup=0.05, grad_ckpt=False):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = AutoModel.from_pretrained(model_name)
        if grad_ckpt:
            self.encoder.gradient_checkpointing_enable()
        h = self.encoder.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(h, len(LABELS)))
        self.val_auc = MultilabelAUROC(num_labels=len(LABELS), average="macro")

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        mask = attention_mask.unsqueeze(-1).type_as(out.last_hidden_state)
        pooled = (out.last_hidden_state * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return self.head(pooled)

    def training_step(self, batch, batch_idx):
        labels = batch.pop("labels")
        logits = self(**batch)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        labels = batch.pop("labels")
        logits = self(**batch)
        self.log("val/loss", F.binary_cross_entropy_with_logits(logits, labels), sync_dist=True)
        self.val_auc.update(torch.sigmoid(logits.float()), labels.long())
        self.log("val/auc", self.val_auc, prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.trainer.estimated_stepping_batches
        sched = get_cosine_schedule_with_warmup(opt, int(self.hparams.warmup * total), total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/jigsaw_train.csv")
    ap.add_argument("--model", default="bert-large-uncased")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1.5e-5)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--out", default="runs/toxic")
    args = ap.parse_args()

    pl.seed_everything(1)
    dm = JigsawDM(args.csv, args.model, max_len=args.max_len, bs=args.bs)
    model = ToxicClassifier(args.model, lr=args.lr, grad_ckpt=args.grad_ckpt)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        # pooler weights get no grad since we mean-pool
        strategy="ddp_find_unused_parameters_true",
        precision="bf16-mixed",
        max_epochs=args.epochs,
        val_check_interval=0.25,
        gradient_clip_val=1.0,
        default_root_dir=args.out,
        logger=TensorBoardLogger(args.out, name="tb"),
        callbacks=[ModelCheckpoint(monitor="val/auc", mode="max", save_top_k=2), LearningRateMonitor("step")],
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
