"""Fine-tune a small CLIP-style dual encoder for image -> caption retrieval on our
product photo / caption pairs.  Lightning 2.1, DDP.

    python 12_lightning_clip_retrieval.py --devices 8 --batch-size 256
"""
import argparse
import math
import os

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from transformers import AutoTokenizer, CLIPModel

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger


class CaptionSet(Dataset):
    def __init__(self, csv_path, image_root, tokenizer, train=True, max_len=64):
        self.df = pd.read_csv(csv_path)
        self.root = image_root
        self.tok = tokenizer
        self.max_len = max_len
        norm = transforms.Normalize((0.4815, 0.4578, 0.4082), (0.2686, 0.2613, 0.2758))
        if train:
            self.tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.6, 1.0)),
                                          transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([transforms.Resize(224), transforms.CenterCrop(224),
                                          transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = self.tf(Image.open(os.path.join(self.root, row.image)).convert("RGB"))
        enc = self.tok(row.caption, padding="max_length", truncation=True, max_length=self.max_len,
                       return_tensors="pt")
        return img, enc["input_ids"][0], enc["attention_mask"][0]


class DualEncoder(pl.LightningModule):
    def __init__(self, clip_name, lr, epochs, steps_per_epoch, warmup_pct=0.1, wd=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.clip = CLIPModel.from_pretrained(clip_name)
        self.val_img, self.val_txt = [], []

    def embed(self, img, ids, mask):
        i = F.normalize(self.clip.get_image_features(pixel_values=img), dim=-1)
        t = F.normalize(self.clip.get_text_features(input_ids=ids, attention_mask=mask), dim=-1)
        return i, t

    def forward(self, img, ids, mask):
        return self.embed(img, ids, mask)

    def training_step(self, batch, batch_idx):
        img, ids, mask = batch
        i, t = self(img, ids, mask)
        if self.trainer.world_size > 1:
            # negatives from all GPUs; local slice keeps its gradient
            i_all = self.all_gather(i, sync_grads=True).flatten(0, 1)
            t_all = self.all_gather(t, sync_grads=True).flatten(0, 1)
        else:
            i_all, t_all = i, t
        scale = self.clip.logit_scale.exp().clamp(max=100)
        logits = scale * i_all @ t_all.T
        labels = torch.arange(logits.size(0), device=self.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        self.log("train/logit_scale", scale, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        img, ids, mask = batch
        i, t = self(img, ids, mask)
        self.val_img.append(i)
        self.val_txt.append(t)

    def on_validation_epoch_end(self):
        i = self.all_gather(torch.cat(self.val_img)).flatten(0, -2) if self.trainer.world_size > 1 else torch.cat(self.val_img)
        t = self.all_gather(torch.cat(self.val_txt)).flatten(0, -2) if self.trainer.world_size > 1 else torch.cat(self.val_txt)
        self.val_img.clear()
        self.val_txt.clear()
        sims = i @ t.T
        gold = torch.arange(sims.size(0), device=sims.device)
        for k in (1, 5, 10):
            topk = sims.topk(k, dim=1).indices
            self.log(f"val/i2t_R@{k}", (topk == gold[:, None]).any(1).float().mean(), sync_dist=True)
            topk = sims.T.topk(k, dim=1).indices
            self.log(f"val/t2i_R@{k}", (topk == gold[:, None]).any(1).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for n, p in self.named_parameters():
            (no_decay if p.ndim < 2 or "logit_scale" in n else decay).append(p)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.hparams.lr, betas=(0.9, 0.98), eps=1e-6)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.hparams.lr, epochs=self.hparams.epochs,
            steps_per_epoch=self.hparams.steps_per_epoch, pct_start=self.hparams.warmup_pct,
            anneal_strategy="cos")
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clip", default="openai/clip-vit-base-patch32")
    ap.add_argument("--train-csv", default="data/captions_train.csv")
    ap.add_argument("--val-csv", default="data/captions_val.csv")
    ap.add_argument("--images", default="data/images")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/clip_ft")
    args = ap.parse_args()

    pl.seed_everything(3)
    tok = AutoTokenizer.from_pretrained(args.clip)
    train_ds = CaptionSet(args.train_csv, args.images, tok, train=True)
    val_ds = CaptionSet(args.val_csv, args.images, tok, train=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True,
                          num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=256, num_workers=args.workers)

    steps_per_epoch = math.floor(len(train_ds) / args.batch_size)
    model = DualEncoder(args.clip, lr=args.lr, epochs=args.epochs, steps_per_epoch=steps_per_epoch)

    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp",
        precision="bf16-mixed",
        max_epochs=args.epochs,
        logger=TensorBoardLogger(args.out),
        callbacks=[ModelCheckpoint(monitor="val/t2i_R@5", mode="max", save_top_k=2),
                   LearningRateMonitor("step")],
        log_every_n_steps=25,
    )
    trainer.fit(model, train_dl, val_dl)


if __name__ == "__main__":
    main()
