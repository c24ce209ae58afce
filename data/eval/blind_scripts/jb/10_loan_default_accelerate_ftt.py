"""Loan-default FT-Transformer trained with HF Accelerate, k-fold with OOF predictions.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        10_loan_default_accelerate_ftt.py --train data/loan/train.csv --test data/loan/test.csv
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader, Dataset
from transformers import get_cosine_schedule_with_warmup

CAT_COLS = ["person_home_ownership", "loan_intent", "loan_grade", "cb_person_default_on_file"]
NUM_COLS = ["person_age", "person_income", "person_emp_length", "loan_amnt", "loan_int_rate",
            "loan_percent_income", "cb_person_cred_hist_length"]
TARGET = "loan_status"


class LoanDataset(Dataset):
    def __init__(self, cat, num, y):
        self.cat = torch.as_tensor(cat, dtype=torch.long)
        self.num = torch.as_tensor(num, dtype=torch.float32)
        self.y = torch.as_tensor(y, dtype=torch.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"idx": i, "cat": self.cat[i], "num": self.num[i], "y": self.y[i]}


class FTTransformer(nn.Module):
    def __init__(self, n_num, cards, d=128, n_layers=3, n_heads=8, dropout=0.1):
        super().__init__()
        self.num_tok = nn.Parameter(torch.randn(n_num, d) * 0.02)
        self.num_bias = nn.Parameter(torch.zeros(n_num, d))
        self.cat_tok = nn.ModuleList(nn.Embedding(c, d) for c in cards)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        block = nn.TransformerEncoderLayer(d, n_heads, d * 2, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, n_layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, cat, num):
        t_num = num.unsqueeze(-1) * self.num_tok + self.num_bias
        t_cat = torch.stack([e(cat[:, i]) for i, e in enumerate(self.cat_tok)], 1)
        x = torch.cat([self.cls.expand(num.size(0), -1, -1), t_num, t_cat], 1)
        return self.head(self.encoder(x)[:, 0]).squeeze(-1)


def preprocess(train, test):
    cards = []
    for c in CAT_COLS:
        levels = sorted(pd.concat([train[c], test[c]]).astype(str).unique())
        lut = {v: i for i, v in enumerate(levels)}
        train[c] = train[c].astype(str).map(lut)
        test[c] = test[c].astype(str).map(lut)
        cards.append(len(levels))
    for df in (train, test):
        df["person_income"] = np.log1p(df["person_income"])
        df["loan_amnt"] = np.log1p(df["loan_amnt"])
    return cards


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", default="runs/loan_ftt")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=256, help="per device")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    accelerator = Accelerator(log_with="tensorboard", project_dir=args.out)
    set_seed(args.seed)
    accelerator.init_trackers("loan_ftt", config=vars(args))

    train = pd.read_csv(args.train)
    test = pd.read_csv(args.test)
    cards = preprocess(train, test)
    y = train[TARGET].values.astype(np.float32)
    oof = np.zeros(len(train), np.float32)
    test_pred = np.zeros(len(test), np.float32)
    skf = StratifiedKFold(args.folds, shuffle=True, random_state=args.seed)
    lr = args.lr * math.sqrt(accelerator.num_processes)

    for fold, (tr_idx, va_idx) in enumerate(skf.split(train, y)):
        mu, sd = train.iloc[tr_idx][NUM_COLS].mean(), train.iloc[tr_idx][NUM_COLS].std()
        norm = lambda df: ((df[NUM_COLS] - mu) / sd).fillna(0).values
        tr_ds = LoanDataset(train.iloc[tr_idx][CAT_COLS].values, norm(train.iloc[tr_idx]), y[tr_idx])
        va_ds = LoanDataset(train.iloc[va_idx][CAT_COLS].values, norm(train.iloc[va_idx]), y[va_idx])
        te_ds = LoanDataset(test[CAT_COLS].values, norm(test), np.zeros(len(test)))
        tr_dl = DataLoader(tr_ds, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
        va_dl = DataLoader(va_ds, batch_size=1024, shuffle=False, num_workers=2)
        te_dl = DataLoader(te_ds, batch_size=1024, shuffle=False, num_workers=2)

        model = FTTransformer(len(NUM_COLS), cards)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
        model, opt, tr_dl, va_dl, te_dl = accelerator.prepare(model, opt, tr_dl, va_dl, te_dl)
        sched = get_cosine_schedule_with_warmup(opt, len(tr_dl), args.epochs * len(tr_dl))

        best_auc = -1.0
        for epoch in range(args.epochs):
            model.train()
            for batch in tr_dl:
                with accelerator.autocast():
                    logits = model(batch["cat"], batch["num"])
                loss = F.binary_cross_entropy_with_logits(logits.float(), batch["y"])
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()

            model.eval()
            ids, probs, labels = [], [], []
            with torch.no_grad():
                for batch in va_dl:
                    p = torch.sigmoid(model(batch["cat"], batch["num"]).float())
                    i, p, t = accelerator.gather((batch["idx"], p, batch["y"]))
                    ids.append(i.cpu())
                    probs.append(p.cpu())
                    labels.append(t.cpu())
            ids, probs, labels = torch.cat(ids).numpy(), torch.cat(probs).numpy(), torch.cat(labels).numpy()
            auc = roc_auc_score(labels, probs)
            accelerator.log({f"fold{fold}/val_auc": auc, f"fold{fold}/loss": loss.item()}, step=epoch)
            accelerator.print(f"fold {fold} epoch {epoch} loss {loss.item():.4f} auc {auc:.5f}")
            if auc > best_auc:
                best_auc = auc
                oof[va_idx[ids]] = probs
                accelerator.save_state(os.path.join(args.out, f"fold{fold}_best"))

        accelerator.wait_for_everyone()
        accelerator.load_state(os.path.join(args.out, f"fold{fold}_best"))
        model.eval()
        with torch.no_grad():
            preds = [accelerator.gather_for_metrics(torch.sigmoid(model(b["cat"], b["num"]).float())).cpu()
                     for b in te_dl]
        test_pred += torch.cat(preds).numpy() / args.folds
        accelerator.print(f"fold {fold} best auc {best_auc:.5f}")
        accelerator.free_memory()
        del model, opt

    if accelerator.is_main_process:
        accelerator.print(f"OOF AUC {roc_auc_score(y, oof):.5f}")
        pd.DataFrame({"id": train["id"], "oof": oof}).to_csv(os.path.join(args.out, "oof.csv"), index=False)
        pd.DataFrame({"id": test["id"], TARGET: test_pred}).to_csv(os.path.join(args.out, "submission.csv"), index=False)
    accelerator.end_training()


if __name__ == "__main__":
    main()
