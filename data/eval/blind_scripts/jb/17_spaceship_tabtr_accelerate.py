"""Spaceship Titanic - TabTransformer, stratified k-fold, HF Accelerate (DDP under the hood).

    accelerate launch --multi_gpu --num_processes 2 17_spaceship_tabtr_accelerate.py \
        --train data/spaceship/train.csv --test data/spaceship/test.csv --report-to wandb
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.metrics import accuracy_score, roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader, Dataset

CATS = ["HomePlanet", "CryoSleep", "Destination", "VIP", "Deck", "Side", "CabinRegion", "GroupSize"]
NUMS = ["Age", "RoomService", "FoodCourt", "ShoppingMall", "Spa", "VRDeck", "TotalSpend"]
SPEND = ["RoomService", "FoodCourt", "ShoppingMall", "Spa", "VRDeck"]


def engineer(df):
    df = df.copy()
    cabin = df["Cabin"].fillna("NA/-1/NA").str.split("/", expand=True)
    df["Deck"], df["Side"] = cabin[0], cabin[2]
    df["CabinRegion"] = (pd.to_numeric(cabin[1], errors="coerce").fillna(-1) // 300).astype(int).astype(str)
    group = df["PassengerId"].str.split("_").str[0]
    df["GroupSize"] = group.map(group.value_counts()).clip(upper=4).astype(str)
    df[SPEND] = df[SPEND].fillna(0.0)
    df["TotalSpend"] = df[SPEND].sum(1)
    df[SPEND + ["TotalSpend"]] = np.log1p(df[SPEND + ["TotalSpend"]])
    for c in ["CryoSleep", "VIP"]:
        df[c] = df[c].astype(str)
    return df


class Rows(Dataset):
    def __init__(self, cat, num, y):
        self.cat, self.num, self.y = torch.as_tensor(cat), torch.as_tensor(num), torch.as_tensor(y)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.cat[i], self.num[i], self.y[i], i


class TabTransformer(nn.Module):
    def __init__(self, cards, n_num, dim=32, depth=4, heads=4, drop=0.15):
        super().__init__()
        self.embeds = nn.ModuleList([nn.Embedding(c, dim) for c in cards])
        enc = nn.TransformerEncoderLayer(dim, heads, dim * 4, drop, activation="gelu", batch_first=True)
        self.tf = nn.TransformerEncoder(enc, depth, enable_nested_tensor=False)
        self.num_norm = nn.LayerNorm(n_num)
        d = dim * len(cards) + n_num
        self.mlp = nn.Sequential(nn.Linear(d, 256), nn.GELU(), nn.Dropout(drop), nn.Linear(256, 64), nn.GELU(),
                                 nn.Linear(64, 1))

    def forward(self, x_cat, x_num):
        t = self.tf(torch.stack([e(x_cat[:, i]) for i, e in enumerate(self.embeds)], 1))
        return self.mlp(torch.cat([t.flatten(1), self.num_norm(x_num)], 1)).squeeze(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", default="runs/spaceship_tabtr")
    ap.add_argument("--folds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=128, help="per device")
    ap.add_argument("--lr", type=float, default=1e-3, help="for a total batch of 128")
    ap.add_argument("--report-to", default="wandb")
    ap.add_argument("--seed", type=int, default=8)
    args = ap.parse_args()

    accelerator = Accelerator(log_with=args.report_to, project_dir=args.out)
    set_seed(args.seed)
    accelerator.init_trackers("spaceship-tabtr", config=vars(args))
    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)

    train, test = engineer(pd.read_csv(args.train)), engineer(pd.read_csv(args.test))
    cards = []
    for c in CATS:
        levels = sorted(set(train[c].astype(str)) | set(test[c].astype(str)))
        lut = {v: i for i, v in enumerate(levels)}
        train[c], test[c] = train[c].astype(str).map(lut), test[c].astype(str).map(lut)
        cards.append(len(levels))
    y = train["Transported"].astype(np.float32).values
    total_batch = args.batch_size * accelerator.num_processes
    lr = args.lr * total_batch / 128

    oof = np.zeros(len(train), np.float32)
    test_pred = np.zeros(len(test), np.float32)
    for fold, (tr_idx, va_idx) in enumerate(StratifiedKFold(args.folds, shuffle=True, random_state=args.seed)
                                            .split(train, y)):
        med = train.iloc[tr_idx][NUMS].median()
        mu, sd = train.iloc[tr_idx][NUMS].fillna(med).mean(), train.iloc[tr_idx][NUMS].fillna(med).std()
        num = lambda f: ((f[NUMS].fillna(med) - mu) / sd).values.astype(np.float32)
        tr_ds = Rows(train.iloc[tr_idx][CATS].values.astype(np.int64), num(train.iloc[tr_idx]), y[tr_idx])
        va_ds = Rows(train.iloc[va_idx][CATS].values.astype(np.int64), num(train.iloc[va_idx]), y[va_idx])
        te_ds = Rows(test[CATS].values.astype(np.int64), num(test), np.zeros(len(test), np.float32))

        # accelerate.prepare shards these loaders across processes and reseeds the shuffle every epoch
        tr_dl = DataLoader(tr_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=2)
        va_dl = DataLoader(va_ds, batch_size=512, shuffle=False, num_workers=2)
        te_dl = DataLoader(te_ds, batch_size=512, shuffle=False, num_workers=2)
        model = TabTransformer(cards, len(NUMS))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
        model, opt, tr_dl, va_dl, te_dl = accelerator.prepare(model, opt, tr_dl, va_dl, te_dl)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(tr_dl))

        best_acc, best_path = -1.0, os.path.join(args.out, f"fold{fold}.pt")
        for epoch in range(args.epochs):
            model.train()
            for xc, xn, yb, _ in tr_dl:
                loss = F.binary_cross_entropy_with_logits(model(xc, xn), yb)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()

            model.eval()
            ps, ids = [], []
            with torch.no_grad():
                for xc, xn, _, i in va_dl:
                    p, i = accelerator.gather_for_metrics((torch.sigmoid(model(xc, xn)), i))
                    ps.append(p.cpu())
                    ids.append(i.cpu())
            p, ids = torch.cat(ps).numpy(), torch.cat(ids).numpy()
            fold_pred = np.zeros(len(va_ds), np.float32)
            fold_pred[ids] = p
            acc = accuracy_score(y[va_idx], fold_pred > 0.5)
            auc = roc_auc_score(y[va_idx], fold_pred)
            accelerator.log({"fold": fold, "val_acc": acc, "val_auc": auc, "train_loss": loss.item()},
                            step=fold * args.epochs + epoch)
            if acc > best_acc:
                best_acc = acc
                oof[va_idx] = fold_pred
                accelerator.wait_for_everyone()
                accelerator.save(accelerator.unwrap_model(model).state_dict(), best_path)

        accelerator.wait_for_everyone()
        accelerator.unwrap_model(model).load_state_dict(torch.load(best_path, map_location="cpu"))
        model.eval()
        with torch.no_grad():
            tp = [accelerator.gather_for_metrics(torch.sigmoid(model(xc, xn))).cpu() for xc, xn, _, _ in te_dl]
        test_pred += torch.cat(tp).numpy() / args.folds
        accelerator.print(f"fold {fold}: best val acc {best_acc:.4f}")
        accelerator.free_memory()
        del model, opt, sched

    if accelerator.is_main_process:
        accelerator.print(f"OOF acc {accuracy_score(y, oof > 0.5):.4f}  auc {roc_auc_score(y, oof):.4f}")
        pd.DataFrame({"PassengerId": train["PassengerId"], "oof": oof}).to_csv(os.path.join(args.out, "oof.csv"), index=False)
        pd.DataFrame({"PassengerId": test["PassengerId"], "Transported": test_pred > 0.5}).to_csv(
            os.path.join(args.out, "submission.csv"), index=False)
    accelerator.end_training()


if __name__ == "__main__":
    main()
