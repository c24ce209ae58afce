"""Full fine-tune of Pythia-1.4B on support-ticket dialogues.
Lightning 2.2, DeepSpeed ZeRO stage 2, bf16, 4 x A100-80GB.

    python 18_lightning_ds2_pythia_sft.py --devices 4 --train data/tickets_train.jsonl --val data/tickets_val.jsonl
"""
import argparse
import math
import os

import torch
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DeepSpeedStrategy

SYSTEM = "You are a helpful support agent."


def format_dialogue(turns, tok):
    """turns: list of {"role": "customer"|"agent", "text": ...}; loss only on agent turns"""
    ids = tok(SYSTEM + "\n", add_special_tokens=False)["input_ids"]
    labels = [-100] * len(ids)
    for t in turns:
        prefix = "Customer: " if t["role"] == "customer" else "Agent: "
        p = tok(prefix, add_special_tokens=False)["input_ids"]
        body = tok(t["text"].strip() + "\n", add_special_tokens=False)["input_ids"]
        ids += p + body
        labels += [-100] * len(p) + (body if t["role"] == "agent" else [-100] * len(body))
    ids.append(tok.eos_token_id)
    labels.append(tok.eos_token_id)
    return ids, labels


class TicketData(L.LightningDataModule):
    def __init__(self, tokenizer_name, train_file, val_file, max_len=2048, batch_size=4, workers=4):
        super().__init__()
        self.tokenizer_name = tokenizer_name
        self.files = {"train": train_file, "validation": val_file}
        self.max_len, self.batch_size, self.workers = max_len, batch_size, workers
        self.tok = AutoTokenizer.from_pretrained(tokenizer_name)
        self.tok.pad_token = self.tok.eos_token

    def _tokenized(self):
        raw = load_dataset("json", data_files=self.files)

        def enc(ex):
            ids, labels = format_dialogue(ex["turns"], self.tok)
            ids, labels = ids[: self.max_len], labels[: self.max_len]
            return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

        ds = raw.map(enc, remove_columns=raw["train"].column_names, num_proc=8, desc="tokenizing")
        ds["train"] = ds["train"].filter(lambda ex: any(l != -100 for l in ex["labels"]), desc="drop empty")
        return ds

    def prepare_data(self):
        # runs once per node (local rank 0); fills the datasets cache
        self._tokenized()

    def setup(self, stage=None):
        ds = self._tokenized()  # cache hit on every rank
        self.train_ds = ds["train"]
        self.val_ds = ds["validation"]

    def _loader(self, ds, shuffle):
        collate = DataCollatorForSeq2Seq(self.tok, padding="longest", label_pad_token_id=-100, pad_to_multiple_of=64)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, collate_fn=collate,
                          num_workers=self.workers, drop_last=shuffle)

    def train_dataloader(self):
        return self._loader(self.train_ds, True)

    def val_dataloader(self):
        return self._loader(self.val_ds, False)


class SFTModule(L.LightningModule):
    def __init__(self, model_name, lr=1e-5, warmup_ratio=0.03, weight_decay=0.0):
        super().__init__()
        self.save_hyperparameters()
        self.model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype=torch.float32)
        self.model.config.use_cache = False

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.log("train/loss", out.loss, prog_bar=True, sync_dist=True)
        return out.loss

    def validation_step(self, batch, batch_idx):
        out = self.model(**batch)
        n_tok = (batch["labels"][:, 1:] != -100).sum()
        self.log("val/loss", out.loss, sync_dist=True, batch_size=int(n_tok))

    def configure_optimizers(self):
        no_decay = ("bias", "layernorm", "layer_norm")
        groups = [
            {"params": [p for n, p in self.named_parameters() if not any(k in n.lower() for k in no_decay)],
             "weight_decay": self.hparams.weight_decay},
            {"params": [p for n, p in self.named_parameters() if any(k in n.lower() for k in no_decay)],
             "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95), eps=1e-8)
        total = self.trainer.estimated_stepping_batches
        warm = max(1, int(self.hparams.warmup_ratio * total))

        def schedule(step):
            if step < warm:
                return step / warm
            return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="EleutherAI/pythia-1.4b-deduped")
    ap.add_argument("--train", default="data/tickets_train.jsonl")
    ap.add_argument("--val", default="data/tickets_val.jsonl")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--out", default="runs/pythia14b_tickets")
    args = ap.parse_args()

    L.seed_everything(42)
    dm = TicketData(args.model, args.train, args.val, batch_size=args.batch_size)
    module = SFTModule(args.model, lr=args.lr)

    strategy = DeepSpeedStrategy(stage=2, offload_optimizer=False, allgather_bucket_size=2e8,
                                 reduce_bucket_size=2e8)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy=strategy,
        precision="bf16-mixed",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accum,
        gradient_clip_val=1.0,
        val_check_interval=0.25,
        logger=CSVLogger(args.out),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), monitor="val/loss", mode="min",
                                   save_top_k=1, save_last=True),
                   LearningRateMonitor("step")],
    )
    trainer.fit(module, datamodule=dm)

    # ZeRO-2 keeps full weights on every rank; rank 0 writes the HF export
    if trainer.is_global_zero:
        export = os.path.join(args.out, "hf_export")
        module.model.save_pretrained(export, safe_serialization=True)
        dm.tok.save_pretrained(export)
        print(f"saved {export}")


if __name__ == "__main__":
    main()
