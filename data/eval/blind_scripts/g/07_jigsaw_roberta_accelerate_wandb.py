#!/usr/bin/env python
# Jigsaw toxic comment severity - pairwise margin ranking with roberta-base.
# accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 \
#     07_jigsaw_roberta_accelerate_wandb.py --run_name rb-margin-0.5
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import wandb
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs_csv", default="input/validation_data.csv")
    p.add_argument("--model_name", default="roberta-base")
    p.add_argument("--max_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--margin", type=float, default=0.5)
    p.add_argument("--val_frac", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=2021)
    p.add_argument("--run_name", default="roberta-margin")
    p.add_argument("--output_dir", default="ckpt")
    return p.parse_args()


class PairDataset(Dataset):
    def __init__(self, df, tokenizer, max_len):
        self.less = df.less_toxic.tolist()
        self.more = df.more_toxic.tolist()
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.less)

    def _enc(self, text):
        e = self.tok(text, truncation=True, max_length=self.max_len, padding="max_length",
                     return_tensors="pt")
        return e["input_ids"][0], e["attention_mask"][0]

    def __getitem__(self, i):
        li, lm = self._enc(self.less[i])
        mi, mm = self._enc(self.more[i])
        return {"less_ids": li, "less_mask": lm, "more_ids": mi, "more_mask": mm}


class ToxicScorer(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(self.encoder.config.hidden_size, 1)

    def forward(self, ids, mask):
        out = self.encoder(input_ids=ids, attention_mask=mask)
        return self.fc(self.drop(out.pooler_output)).squeeze(-1)


def main():
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)

    wandb.init(project="jigsaw-severity", name=args.run_name, config=vars(args))

    df = pd.read_csv(args.pairs_csv)
    df = df.sample(frac=1.0, random_state=args.seed).reset_index(drop=True)
    n_val = int(len(df) * args.val_frac)
    val_df, trn_df = df.iloc[:n_val], df.iloc[n_val:]

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = PairDataset(trn_df, tokenizer, args.max_len)
    val_ds = PairDataset(val_df, tokenizer, args.max_len)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=2, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size * 2, shuffle=False, num_workers=2)

    model = ToxicScorer(args.model_name)
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr * accelerator.num_processes)
    # schedule length in single-process steps; the prepared scheduler steps once per process
    steps = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * steps), steps)
    model, optimizer, train_dl, val_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, val_dl, scheduler)
    loss_fn = nn.MarginRankingLoss(margin=args.margin)

    best_acc = -math.inf
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            ids = torch.cat([batch["less_ids"], batch["more_ids"]])
            mask = torch.cat([batch["less_mask"], batch["more_mask"]])
            s_less, s_more = model(ids, mask).chunk(2)
            target = torch.ones_like(s_less)
            loss = loss_fn(s_more, s_less, target)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=global_step)

        model.eval()
        agree = []
        with torch.no_grad():
            for batch in val_dl:
                ids = torch.cat([batch["less_ids"], batch["more_ids"]])
                mask = torch.cat([batch["less_mask"], batch["more_mask"]])
                s_less, s_more = model(ids, mask).chunk(2)
                ok = (s_more > s_less).float()
                agree.append(accelerator.gather_for_metrics(ok))
        acc = torch.cat(agree).mean().item()
        accelerator.print(f"epoch {epoch}: pair accuracy {acc:.4f}")
        if accelerator.is_main_process:
            wandb.log({"val/pair_acc": acc, "epoch": epoch}, step=global_step)

        if acc > best_acc:
            best_acc = acc
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            if accelerator.is_main_process:
                os.makedirs(args.output_dir, exist_ok=True)
                accelerator.save(unwrapped.state_dict(), os.path.join(args.output_dir, f"{args.run_name}.bin"))
                tokenizer.save_pretrained(args.output_dir)

    if accelerator.is_main_process:
        wandb.run.summary["best_pair_acc"] = best_acc
    wandb.finish()
    accelerator.end_training()


if __name__ == "__main__":
    main()
