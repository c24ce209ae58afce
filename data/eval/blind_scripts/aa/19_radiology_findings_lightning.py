"""Radiology report -> primary finding category (Bio_ClinicalBERT), PyTorch Lightning DDP.

    python 19_radiology_findings_lightning.py --reports data/reports.parquet --gpus 4 --out runs/rad_findings
"""
import argparse
import os
import re

import pandas as pd
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torchmetrics
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from sklearn.model_selection import GroupShuffleSplit
from sklearn.preprocessing import LabelEncoder
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer

MODEL_NAME = "emilyalsentzer/Bio_ClinicalBERT"
SECTION_RE = re.compile(r"(FINDINGS|IMPRESSION)\s*:\s*(.*?)(?=\n[A-Z ]{4,}:|\Z)", re.S)


def extract_sections(report):
    parts = {k: v.strip() for k, v in SECTION_RE.findall(report or "")}
    text = (parts.get("IMPRESSION", "") + " [SEP] " + parts.get("FINDINGS", "")).strip()
    return re.sub(r"\s+", " ", text)


def load_reports(path, min_len=30):
    df = pd.read_parquet(path, columns=["report_id", "patient_id", "report_text", "finding"])
    df["text"] = df["report_text"].map(extract_sections)
    df = df[df["text"].str.len() >= min_len]
    df["finding"] = df["finding"].str.strip().str.lower()
    df = df.drop_duplicates(subset=["patient_id", "text"]).reset_index(drop=True)
    return df


class ReportDataset(Dataset):
    def __init__(self, df, tokenizer, max_len):
        self.enc = tokenizer(df["text"].tolist(), truncation=True, max_length=max_len, padding="max_length",
                             return_tensors="pt")
        self.y = torch.tensor(df["label_id"].values, dtype=torch.long)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.enc["input_ids"][i], self.enc["attention_mask"][i], self.y[i]


class FindingClassifier(pl.LightningModule):
    def __init__(self, num_classes, lr=2e-5, dropout=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.bert = AutoModel.from_pretrained(MODEL_NAME)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(self.bert.config.hidden_size, num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_f1 = torchmetrics.F1Score(task="multiclass", num_classes=num_classes, average="macro")

    def forward(self, ids, mask):
        return self.out(self.drop(self.bert(input_ids=ids, attention_mask=mask).pooler_output))

    def training_step(self, batch, _):
        ids, mask, y = batch
        loss = nn.functional.cross_entropy(self(ids, mask), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        ids, mask, y = batch
        logits = self(ids, mask)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.val_acc(logits, y)
        self.val_f1(logits, y)
        self.log("val_acc", self.val_acc, on_epoch=True)
        self.log("val_f1", self.val_f1, on_epoch=True, prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr,
                                                    total_steps=self.trainer.estimated_stepping_batches,
                                                    pct_start=0.1)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reports", required=True)
    ap.add_argument("--out", default="runs/rad_findings")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--max_len", type=int, default=384)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5, help="tuned on 4 GPUs x 16")
    ap.add_argument("--seed", type=int, default=21)
    args = ap.parse_args()
    pl.seed_everything(args.seed, workers=True)

    df = load_reports(args.reports)
    encoder = LabelEncoder()
    df["label_id"] = encoder.fit_transform(df["finding"])

    # split by patient so repeat studies of one patient stay on one side
    gss = GroupShuffleSplit(n_splits=1, test_size=0.15, random_state=args.seed)
    tr, va = next(gss.split(df, groups=df["patient_id"]))
    train_df, val_df = df.iloc[tr], df.iloc[va]
    num_classes = train_df["label_id"].nunique()

    tok = AutoTokenizer.from_pretrained(MODEL_NAME)
    train_dl = DataLoader(ReportDataset(train_df, tok, args.max_len), batch_size=args.batch_size, shuffle=True,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(ReportDataset(val_df, tok, args.max_len), batch_size=64, num_workers=4, pin_memory=True)

    model = FindingClassifier(num_classes=num_classes, lr=args.lr)
    ckpt_cb = ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), monitor="val_f1", mode="max",
                              save_top_k=1, save_last=True, filename="best-{epoch:02d}-{val_f1:.4f}")
    trainer = pl.Trainer(
        accelerator="gpu", devices=args.gpus, strategy="ddp", precision="16-mixed",
        max_epochs=args.epochs, gradient_clip_val=1.0, deterministic=False,
        callbacks=[ckpt_cb, EarlyStopping(monitor="val_f1", mode="max", patience=3)],
        logger=TensorBoardLogger(args.out, name="tb"), log_every_n_steps=25,
    )
    last = os.path.join(args.out, "checkpoints", "last.ckpt")
    trainer.fit(model, train_dl, val_dl, ckpt_path=last if os.path.exists(last) else None)

    if trainer.is_global_zero:
        pd.Series(encoder.classes_).to_csv(os.path.join(args.out, "label_classes.csv"), index=False, header=False)
        print(f"best checkpoint: {ckpt_cb.best_model_path} ({ckpt_cb.best_model_score})")


if __name__ == "__main__":
    main()
