"""AG-News style topic classification, DistilRoBERTa + linear head, Lightning.

Tokenised tensors are cached to disk so restarts don't re-tokenise 120k articles.

    python 06_textcls_news_lightning_cache.py --train data/news_train.csv \
        --val data/news_test.csv --devices 8
"""
import argparse
import hashlib
import os

import pandas as pd
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

NUM_CLASSES = 4


def cache_key(path, model_name, max_len):
    h = hashlib.md5(f"{os.path.abspath(path)}|{model_name}|{max_len}".encode()).hexdigest()[:10]
    return f"{os.path.splitext(os.path.basename(path))[0]}-{h}.pt"


class NewsDataModule(pl.LightningDataModule):
    def __init__(self, train_csv, val_csv, model_name, max_len=128, batch_size=64,
                 cache_dir=".cache/news", num_workers=4):
        super().__init__()
        self.train_csv = train_csv
        self.val_csv = val_csv
        self.model_name = model_name
        self.max_len = max_len
        self.batch_size = batch_size
        self.cache_dir = cache_dir
        self.num_workers = num_workers

    def prepare_data(self):
        # make sure the tokenizer files are in the HF cache
        AutoTokenizer.from_pretrained(self.model_name)

    def _encode(self, csv_path):
        os.makedirs(self.cache_dir, exist_ok=True)
        cache_path = os.path.join(self.cache_dir, cache_key(csv_path, self.model_name, self.max_len))
        if os.path.exists(cache_path):
            blob = torch.load(cache_path)
            return TensorDataset(blob["input_ids"], blob["attention_mask"], blob["labels"])
        tok = AutoTokenizer.from_pretrained(self.model_name)
        df = pd.read_csv(csv_path)
        texts = (df["title"].fillna("") + ". " + df["description"].fillna("")).tolist()
        enc = tok(texts, truncation=True, max_length=self.max_len, padding="max_length",
                  return_tensors="pt")
        labels = torch.tensor(df["label"].values - 1, dtype=torch.long)
        torch.save({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                    "labels": labels}, cache_path)
        return TensorDataset(enc["input_ids"], enc["attention_mask"], labels)

    def setup(self, stage=None):
        if stage in (None, "fit"):
            self.train_ds = self._encode(self.train_csv)
        self.val_ds = self._encode(self.val_csv)

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers, pin_memory=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.batch_size * 2,
                          num_workers=self.num_workers, pin_memory=True)


class NewsClassifier(pl.LightningModule):
    def __init__(self, model_name, lr=3e-5, warmup_ratio=0.06, dropout=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = AutoModel.from_pretrained(model_name, add_pooling_layer=False)
        hidden = self.encoder.config.hidden_size
        self.drop = nn.Dropout(dropout)
        self.cls = nn.Linear(hidden, NUM_CLASSES)
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES)
        self.val_f1 = MulticlassF1Score(num_classes=NUM_CLASSES, average="macro")

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.cls(self.drop(h[:, 0]))

    def training_step(self, batch, batch_idx):
        ids, mask, y = batch
        loss = F.cross_entropy(self(ids, mask), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, mask, y = batch
        logits = self(ids, mask)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.val_f1(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)
        self.log("val_f1", self.val_f1)

    def configure_optimizers(self):
        no_decay = ("bias", "LayerNorm.weight")
        groups = [
            {"params": [p for n, p in self.named_parameters() if not any(k in n for k in no_decay)],
             "weight_decay": 0.01},
            {"params": [p for n, p in self.named_parameters() if any(k in n for k in no_decay)],
             "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr)
        total = self.trainer.estimated_stepping_batches
        sched = get_linear_schedule_with_warmup(opt, int(self.hparams.warmup_ratio * total), total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="data/news_train.csv")
    ap.add_argument("--val", default="data/news_test.csv")
    ap.add_argument("--model", default="distilroberta-base")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--cache-dir", default=".cache/news")
    args = ap.parse_args()

    pl.seed_everything(17)
    dm = NewsDataModule(args.train, args.val, args.model, batch_size=args.bs, cache_dir=args.cache_dir)
    model = NewsClassifier(args.model, lr=args.lr)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp",
        precision="16-mixed",
        max_epochs=args.epochs,
        val_check_interval=0.5,
        logger=TensorBoardLogger("tb", name="news"),
        callbacks=[ModelCheckpoint(monitor="val_f1", mode="max", save_top_k=1)],
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
