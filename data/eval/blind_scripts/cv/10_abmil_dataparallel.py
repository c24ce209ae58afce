"""Gated ABMIL, lymph-node metastasis detection, single node / multi-GPU.

Runs on the 4-GPU workstation; nn.DataParallel so there is no launcher to deal with.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python 10_abmil_dataparallel.py --fold 0
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--feat_root", default="/data/ln_mets/FEATURES_DIRECTORY")
    ap.add_argument("--label_csv", default="/data/ln_mets/slide_labels.csv")
    ap.add_argument("--split_dir", default="/data/ln_mets/splits/task_ln_100")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--reg", type=float, default=1e-5)
    ap.add_argument("--early_stop", type=int, default=20)
    ap.add_argument("--log_dir", default="runs/ln_abmil")
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


class SlideDataset(Dataset):
    def __init__(self, frame, feat_root):
        self.frame = frame.reset_index(drop=True)
        self.feat_root = feat_root

    def __len__(self):
        return len(self.frame)

    def __getitem__(self, i):
        sid = self.frame.slide_id[i]
        feats = torch.load(os.path.join(self.feat_root, "pt_files", sid + ".pt"), map_location="cpu")
        return feats, int(self.frame.label[i])


class GatedAttentionMIL(nn.Module):
    def __init__(self, in_dim=1024, L=512, D=256, n_classes=2, dropout=0.25):
        super().__init__()
        self.feature = nn.Sequential(nn.Linear(in_dim, L), nn.ReLU(), nn.Dropout(dropout))
        self.attention_V = nn.Sequential(nn.Linear(L, D), nn.Tanh())
        self.attention_U = nn.Sequential(nn.Linear(L, D), nn.Sigmoid())
        self.attention_w = nn.Linear(D, 1)
        self.classifier = nn.Linear(L, n_classes)

    def forward(self, x):
        H = self.feature(x)                                  # N x L
        A = self.attention_w(self.attention_V(H) * self.attention_U(H))
        A = F.softmax(A.transpose(1, 0), dim=1)              # 1 x N
        M = torch.mm(A, H)                                   # 1 x L
        return self.classifier(M), A


def split_frames(args):
    labels = pd.read_csv(args.label_csv)
    split = pd.read_csv(os.path.join(args.split_dir, f"splits_{args.fold}.csv"))
    out = {}
    for name in ("train", "val", "test"):
        ids = split[name].dropna().tolist()
        out[name] = labels[labels.slide_id.isin(ids)]
    return out


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    probs, ys, loss_sum = [], [], 0.0
    for feats, y in loader:
        feats, y = feats.squeeze(0).to(device), y.to(device)
        logits, _ = model(feats)
        loss_sum += F.cross_entropy(logits, y).item()
        probs.append(F.softmax(logits, dim=1)[:, 1].cpu())
        ys.append(y.cpu())
    probs, ys = torch.cat(probs).numpy(), torch.cat(ys).numpy()
    return loss_sum / len(loader), roc_auc_score(ys, probs), accuracy_score(ys, probs > 0.5)


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device("cuda")

    frames = split_frames(args)
    loaders = {
        name: DataLoader(SlideDataset(df, args.feat_root), batch_size=1, shuffle=(name == "train"),
                         num_workers=8, pin_memory=True)
        for name, df in frames.items()
    }
    print({k: len(v) for k, v in frames.items()})

    model = GatedAttentionMIL()
    if torch.cuda.device_count() > 1:
        print(f"using {torch.cuda.device_count()} GPUs")
        model = nn.DataParallel(model)
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.reg)

    log_dir = os.path.join(args.log_dir, f"fold{args.fold}")
    writer = SummaryWriter(log_dir)
    ckpt_path = os.path.join(log_dir, "best_model.pt")
    best_loss, patience = float("inf"), 0

    for epoch in range(args.epochs):
        model.train()
        t0, tr_loss, correct = time.time(), 0.0, 0
        for feats, y in loaders["train"]:
            feats, y = feats.squeeze(0).to(device), y.to(device)
            logits, _ = model(feats)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tr_loss += loss.item()
            correct += int(logits.argmax(1).item() == y.item())
        tr_loss /= len(loaders["train"])
        val_loss, val_auc, val_acc = run_eval(model, loaders["val"], device)

        writer.add_scalar("loss/train", tr_loss, epoch)
        writer.add_scalar("acc/train", correct / len(loaders["train"]), epoch)
        writer.add_scalar("loss/val", val_loss, epoch)
        writer.add_scalar("auc/val", val_auc, epoch)
        print(f"epoch {epoch}: train {tr_loss:.4f}  val {val_loss:.4f}  auc {val_auc:.4f}  "
              f"acc {val_acc:.4f}  ({time.time() - t0:.0f}s)")

        if val_loss < best_loss:
            best_loss, patience = val_loss, 0
            state = model.module.state_dict() if isinstance(model, nn.DataParallel) else model.state_dict()
            torch.save(state, ckpt_path)
        else:
            patience += 1
            if patience >= args.early_stop and epoch >= 50:
                print("early stopping")
                break

    best = GatedAttentionMIL().to(device)
    best.load_state_dict(torch.load(ckpt_path, map_location=device))
    _, test_auc, test_acc = run_eval(best, loaders["test"], device)
    print(f"fold {args.fold}: test auc {test_auc:.4f}  acc {test_acc:.4f}")
    writer.add_scalar("auc/test", test_auc)
    writer.close()
    pd.DataFrame([{"fold": args.fold, "test_auc": test_auc, "test_acc": test_acc, "val_loss": best_loss}]).to_csv(
        os.path.join(log_dir, "summary.csv"), index=False)


if __name__ == "__main__":
    main()
