"""Continued fine-tuning of TinyLlama-1.1B on an in-house domain corpus.

Lightning 2.2 + FSDP (full shard), bf16, 8 x A100 40GB, single node:
    python 08_lightning_fsdp_llama_export.py --devices 8 --data data/domain_corpus.jsonl

At the end of training the model is exported in HF format (export/) for vLLM serving.
"""
import argparse
import functools
import os

import torch
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import lightning as L
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import FSDPStrategy


class PackedCorpus(L.LightningDataModule):
    def __init__(self, path, tokenizer_name, seq_len=2048, batch_size=4, num_workers=4):
        super().__init__()
        self.path, self.tokenizer_name = path, tokenizer_name
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers

    def _build(self):
        tok = AutoTokenizer.from_pretrained(self.tokenizer_name)
        raw = load_dataset("json", data_files=self.path, split="train")
        raw = raw.train_test_split(test_size=0.01, seed=0)
        L_ = self.seq_len

        def tokenize(batch):
            return tok([t + tok.eos_token for t in batch["text"]], add_special_tokens=False)

        def pack(batch):
            ids = sum(batch["input_ids"], [])
            n = (len(ids) // L_) * L_
            chunks = [ids[i:i + L_] for i in range(0, n, L_)]
            return {"input_ids": chunks, "labels": [c[:] for c in chunks], "attention_mask": [[1] * L_ for _ in chunks]}

        out = {}
        for split, ds in raw.items():
            ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names, num_proc=16)
            ds = ds.map(pack, batched=True, remove_columns=ds.column_names, num_proc=16)
            out[split] = ds.with_format("torch")
        return out

    def prepare_data(self):
        self._build()

    def setup(self, stage=None):
        ds = self._build()
        self.train_ds, self.val_ds = ds["train"], ds["test"]

    def train_dataloader(self):
        return DataLoader(self.train_ds, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          collate_fn=default_data_collator, num_workers=self.num_workers)

    def val_dataloader(self):
        return DataLoader(self.val_ds, batch_size=self.batch_size, collate_fn=default_data_collator,
                          num_workers=self.num_workers)


class CausalLM(L.LightningModule):
    def __init__(self, model_name, lr=2e-5, warmup=200, weight_decay=0.0):
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self):
        if self.model is not None:
            return
        self.model = AutoModelForCausalLM.from_pretrained(self.hparams.model_name, torch_dtype=torch.bfloat16)
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = False

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.trainer.model.parameters(), lr=self.hparams.lr,
                                weight_decay=self.hparams.weight_decay, betas=(0.9, 0.95))
        total = self.trainer.estimated_stepping_batches
        warm = self.hparams.warmup

        def lr_lambda(step):
            if step < warm:
                return (step + 1) / warm
            return max(0.1, 1 - (step - warm) / max(1, total - warm))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ExportHF(Callback):
    """write an HF checkpoint for serving once training is finished"""

    def __init__(self, out_dir, tokenizer_name):
        self.out_dir = out_dir
        self.tokenizer_name = tokenizer_name

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            os.makedirs(self.out_dir, exist_ok=True)
            state_dict = pl_module.model.state_dict()
            state_dict = {k: v.to(torch.bfloat16).cpu() for k, v in state_dict.items()}
            pl_module.model.save_pretrained(self.out_dir, state_dict=state_dict, safe_serialization=True)
            AutoTokenizer.from_pretrained(self.tokenizer_name).save_pretrained(self.out_dir)
            print(f"exported HF model to {self.out_dir}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T")
    ap.add_argument("--data", default="data/domain_corpus.jsonl")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=6000)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--out", default="runs/tinyllama_domain")
    args = ap.parse_args()

    L.seed_everything(1337)
    dm = PackedCorpus(args.data, args.model, batch_size=args.batch_size)
    module = CausalLM(args.model, lr=args.lr)

    strategy = FSDPStrategy(
        auto_wrap_policy={LlamaDecoderLayer},
        sharding_strategy="FULL_SHARD",
        state_dict_type="sharded",
        limit_all_gathers=True,
        cpu_offload=False,
    )
    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy=strategy,
        precision="bf16-true",
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accum,
        val_check_interval=500,
        limit_val_batches=50,
        logger=WandbLogger(project="tinyllama-domain", save_dir=args.out),
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=1000, save_last=True),
            LearningRateMonitor("step"),
            ExportHF(os.path.join(args.out, "export"), args.model),
        ],
    )
    trainer.fit(module, datamodule=dm)


if __name__ == "__main__":
    main()
