"""arXiv abstract -> primary subject classifier with PyTorch Lightning (SciBERT backbone).

Slurm (Lightning reads the SLURM_* variables itself):
    #SBATCH --nodes=2 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=10
    srun python 12_arxiv_subject_lightning.py --raw /project/data/arxiv-metadata.jsonl \
        --cache_dir /project/cache/arxiv --out_dir /project/runs/arxiv_scibert
"""
import argparse
import datetime
import json
import os

import lightning as L
import torch
import torch.nn as nn
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset, random_split
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

BACKBONE = "allenai/scibert_scivocab_uncased"


class ArxivDataModule(L.LightningDataModule):
    def __init__(self, raw_path, cache_dir, max_len=256, batch_size=32, min_count=200, seed=13):
        super().__init__()
        self.save_hyperparameters()
        # the cache lives on the shared project filesystem: build it once for the whole job, not once per node
        self.prepare_data_per_node = False
        self.cache_file = os.path.join(cache_dir, f"arxiv_len{max_len}_min{min_count}.pt")

    def prepare_data(self):
        if os.path.exists(self.cache_file):
            return
        hp = self.hparams
        texts, cats = [], []
        with open(hp.raw_path) as f:
            for line in f:
                rec = json.loads(line)
                primary = rec["categories"].split()[0]
                texts.append((rec["title"] + " [SEP] " + rec["abstract"]).replace("\n", " ").strip())
                cats.append(primary.split(".")[0] if "." in primary else primary)
        counts = {}
        for c in cats:
            counts[c] = counts.get(c, 0) + 1
        classes = sorted(c for c, n in counts.items() if n >= hp.min_count)
        c2i = {c: i for i, c in enumerate(classes)}
        keep = [i for i, c in enumerate(cats) if c in c2i]
        tok = AutoTokenizer.from_pretrained(BACKBONE)
        enc = tok([texts[i] for i in keep], truncation=True, max_length=hp.max_len, padding="max_length",
                  return_tensors="pt")
        labels = torch.tensor([c2i[cats[i]] for i in keep])
        os.makedirs(hp.cache_dir, exist_ok=True)
        tmp = self.cache_file + f".tmp{os.getpid()}"
        torch.save({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                    "labels": labels, "classes": classes}, tmp)
        os.replace(tmp, self.cache_file)

    def setup(self, stage=None):
        blob = torch.load(self.cache_file)
        self.classes = blob["classes"]
        full = TensorDataset(blob["input_ids"], blob["attention_mask"], blob["labels"])
        n_val = int(0.05 * len(full))
        # the official test set is scored afterwards by a separate single-GPU script
        self.train_set, self.val_set = random_split(
            full, [len(full) - n_val, n_val], generator=torch.Generator().manual_seed(self.hparams.seed))
        train_labels = blob["labels"][torch.as_tensor(self.train_set.indices)]
        freq = torch.bincount(train_labels, minlength=len(self.classes)).float()
        self.class_weights = (freq.sum() / (len(self.classes) * freq.clamp(min=1))).sqrt()

    def train_dataloader(self):
        # Lightning swaps in a DistributedSampler and calls set_epoch on it
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, num_workers=8,
                          pin_memory=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=128, num_workers=4, pin_memory=True)


class SubjectClassifier(L.LightningModule):
    def __init__(self, lr=3e-5, warmup_frac=0.06):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = AutoModel.from_pretrained(BACKBONE, add_pooling_layer=False)
        self.head = None

    def setup(self, stage):
        # the datamodule's setup has already run (after prepare_data and a barrier), so the label set is known
        if self.head is not None:
            return
        dm = self.trainer.datamodule
        num_classes = len(dm.classes)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(self.encoder.config.hidden_size, num_classes))
        self.register_buffer("class_weights", dm.class_weights.clone())
        self.val_f1 = torchmetrics.F1Score(task="multiclass", num_classes=num_classes, average="macro")
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, input_ids, attention_mask):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        return self.head(out.last_hidden_state[:, 0])

    def training_step(self, batch, batch_idx):
        ids, mask, y = batch
        loss = nn.functional.cross_entropy(self(ids, mask), y, weight=self.class_weights)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, mask, y = batch
        logits = self(ids, mask)
        self.log("val/loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_f1.update(logits, y)
        self.val_acc.update(logits, y)
        self.log("val/macro_f1", self.val_f1, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_epoch=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.trainer.estimated_stepping_batches
        sched = get_linear_schedule_with_warmup(opt, int(self.hparams.warmup_frac * total), total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--nodes", type=int, default=int(os.environ.get("SLURM_NNODES", 1)))
    ap.add_argument("--gpus_per_node", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--max_epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-5, help="tuned for the 2x4 GPU global batch (32 x 2 accum x 8)")
    args = ap.parse_args()

    L.seed_everything(13, workers=True)
    dm = ArxivDataModule(args.raw, args.cache_dir, batch_size=args.batch_size)
    model = SubjectClassifier(lr=args.lr)
    trainer = L.Trainer(
        accelerator="gpu", devices=args.gpus_per_node, num_nodes=args.nodes,
        # global rank 0 tokenizes the whole dump on the first run while the other ranks wait
        strategy=DDPStrategy(timeout=datetime.timedelta(hours=2)),
        precision="bf16-mixed", max_epochs=args.max_epochs, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0, default_root_dir=args.out_dir, logger=CSVLogger(args.out_dir, name="logs"),
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(args.out_dir, "ckpt"), monitor="val/macro_f1", mode="max",
                            save_top_k=2, save_last=True, filename="{epoch}-{val/macro_f1:.4f}",
                            auto_insert_metric_name=False),
            EarlyStopping(monitor="val/macro_f1", mode="max", patience=2),
            LearningRateMonitor(logging_interval="step"),
        ],
        log_every_n_steps=50,
    )
    last = os.path.join(args.out_dir, "ckpt", "last.ckpt")
    trainer.fit(model, datamodule=dm, ckpt_path=last if os.path.exists(last) else None)
    if trainer.is_global_zero:
        best = trainer.checkpoint_callback.best_model_path
        with open(os.path.join(args.out_dir, "best_checkpoint.txt"), "w") as f:
            f.write(f"{best}\t{trainer.checkpoint_callback.best_model_score}\n")


if __name__ == "__main__":
    main()
