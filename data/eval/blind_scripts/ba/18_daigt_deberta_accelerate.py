"""LLM - Detect AI Generated Text. deberta-v3 classifier, holdout fold + one pseudo-label round on test.

accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 18_daigt_deberta_accelerate.py \
    --model microsoft/deberta-v3-base --pl-rounds 1
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="/data/daigt/train_v2_drcat_02.csv")
    p.add_argument("--test", default="/data/llm-detect-ai-generated-text/test_essays.csv")
    p.add_argument("--model", default="microsoft/deberta-v3-base")
    p.add_argument("--out", default="./daigt_debv3b")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--patience", type=int, default=1)
    p.add_argument("--pl-rounds", type=int, default=1)
    p.add_argument("--pl-thr", type=float, default=0.97)
    p.add_argument("--valid-fold", type=int, default=0)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class EssayDS(Dataset):
    def __init__(self, texts, labels, tok, max_len):
        self.texts, self.labels, self.tok, self.max_len = list(texts), np.asarray(labels, np.float32), tok, max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_len)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": self.labels[i]}


def collate_fn(pad_id):
    def _collate(batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for k, b in enumerate(batch):
            ids[k, :len(b["input_ids"])] = torch.tensor(b["input_ids"])
            mask[k, :len(b["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([b["labels"] for b in batch])}
    return _collate


def predict(model, loader, accelerator):
    model.eval()
    out = []
    with torch.no_grad():
        for batch in loader:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
            out.append(accelerator.gather_for_metrics(torch.sigmoid(logits.float())).cpu().numpy())
    return np.concatenate(out)


def train_round(rnd, trn_texts, trn_labels, val_df, test_df, tok, args, accelerator):
    set_seed(args.seed + rnd)
    collate = collate_fn(tok.pad_token_id)
    train_dl = DataLoader(EssayDS(trn_texts, trn_labels, tok, args.max_len), batch_size=args.bs, shuffle=True,
                          collate_fn=collate, num_workers=2, drop_last=True)
    valid_dl = DataLoader(EssayDS(val_df.text, val_df.label, tok, args.max_len), batch_size=args.bs * 2,
                          collate_fn=collate, num_workers=2)
    test_dl = DataLoader(EssayDS(test_df.text, np.zeros(len(test_df)), tok, args.max_len), batch_size=args.bs * 2,
                         collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, opt, train_dl, valid_dl, test_dl = accelerator.prepare(model, opt, train_dl, valid_dl, test_dl)
    # train_dl is already sharded here, so this is the number of optimizer updates each process makes
    updates = math.ceil(len(train_dl) / args.accum) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * updates), updates)
    bce = nn.BCEWithLogitsLoss()
    ckpt_dir = os.path.join(args.out, f"round{rnd}")

    best, bad, step = -1.0, 0, 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
                loss = bce(logits.float(), batch["labels"].float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                sched.step()
                step += 1
                if step % 100 == 0:
                    avg = accelerator.reduce(loss.detach(), reduction="mean").item()
                    accelerator.log({f"r{rnd}/train_loss": avg, f"r{rnd}/lr": sched.get_last_lr()[0]}, step=step)

        # gather_for_metrics drops the duplicated tail samples, and every process gets the same array back
        val_pred = predict(model, valid_dl, accelerator)
        auc = roc_auc_score(val_df.label.values, val_pred)
        accelerator.print(f"round {rnd} epoch {epoch} valid auc {auc:.5f}")
        accelerator.log({f"r{rnd}/val_auc": auc}, step=step)
        if auc > best:
            best, bad = auc, 0
            accelerator.wait_for_everyone()
            accelerator.unwrap_model(model).save_pretrained(
                ckpt_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
            if accelerator.is_main_process:
                tok.save_pretrained(ckpt_dir)
                val_df.assign(pred=val_pred).to_csv(os.path.join(args.out, f"oof_round{rnd}.csv"), index=False)
        else:
            bad += 1
        if bad > args.patience:  # same auc on every process, so all of them leave the loop together
            break

    # reload the best epoch on every process for the test prediction
    accelerator.wait_for_everyone()
    best_model = AutoModelForSequenceClassification.from_pretrained(ckpt_dir, num_labels=1)
    accelerator.unwrap_model(model).load_state_dict(best_model.state_dict())
    test_pred = predict(model, test_dl, accelerator)
    accelerator.free_memory()
    return best, test_pred


def main():
    args = get_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, log_with="wandb")
    accelerator.init_trackers("daigt", config=vars(args))
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    df = pd.read_csv(args.train).dropna(subset=["text"]).reset_index(drop=True)
    df["fold"] = pd.util.hash_pandas_object(df.text, index=False).values % 5  # deterministic on every process
    trn_df = df[df.fold != args.valid_fold].reset_index(drop=True)
    val_df = df[df.fold == args.valid_fold].reset_index(drop=True)
    test_df = pd.read_csv(args.test)
    accelerator.print(f"train {len(trn_df)} valid {len(val_df)} test {len(test_df)} | {accelerator.num_processes} procs")

    texts, labels = trn_df.text.tolist(), trn_df.label.values
    for rnd in range(args.pl_rounds + 1):
        best, test_pred = train_round(rnd, texts, labels, val_df, test_df, tok, args, accelerator)
        accelerator.print(f"round {rnd} best valid auc {best:.5f}")
        if accelerator.is_main_process:
            test_df[["id"]].assign(generated=test_pred).to_csv(os.path.join(args.out, f"sub_round{rnd}.csv"), index=False)
        conf = (test_pred > args.pl_thr) | (test_pred < 1 - args.pl_thr)
        texts = trn_df.text.tolist() + test_df.text[conf].tolist()
        labels = np.concatenate([trn_df.label.values, (test_pred[conf] > 0.5).astype(np.float32)])
        accelerator.print(f"  {conf.sum()} confident test essays added as pseudo labels")

    accelerator.end_training()


if __name__ == "__main__":
    main()
