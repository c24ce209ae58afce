"""Point-level stay / move segmentation of raw GPS tracks with a BiLSTM.

Every GPS fix is labelled stay (1) or move (0); labels come from the annotated
subset of the MDC / GeoLife staypoint benchmark. Per-point features: speed,
acceleration, bearing change, time gap, local point density (50 m / 5 min),
distance to the rolling centroid. Single node, nn.DataParallel over the GPUs.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python 15_staypoint_bilstm_dp.py --data data/staypoint_labelled.npz
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, precision_recall_fscore_support
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
log = logging.getLogger(__name__)

FEATURES = ["speed", "accel", "dbearing", "dt", "density", "centroid_dist"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/staypoint_labelled.npz")
    p.add_argument("--out", default="models/staypoint_bilstm")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=64, help="total over all GPUs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class TrackDataset(Dataset):
    def __init__(self, feats, labels, max_len, mean, std):
        self.feats, self.labels, self.max_len = feats, labels, max_len
        self.mean, self.std = mean, std

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        f = (self.feats[i][: self.max_len] - self.mean) / self.std
        y = self.labels[i][: self.max_len]
        return torch.from_numpy(f.astype(np.float32)), torch.from_numpy(y.astype(np.int64))


def collate(batch):
    xs, ys = zip(*batch)
    lengths = torch.tensor([len(x) for x in xs], dtype=torch.long)
    return pad_sequence(xs, batch_first=True), pad_sequence(ys, batch_first=True, padding_value=-100), lengths


class StayPointTagger(nn.Module):
    def __init__(self, n_feat, hidden, layers):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(n_feat, hidden), nn.ReLU())
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True,
                            bidirectional=True, dropout=0.2)
        self.out = nn.Linear(2 * hidden, 2)

    def forward(self, x, lengths):
        self.lstm.flatten_parameters()
        h = self.inp(x)
        packed = pack_padded_sequence(h, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        return self.out(out)


def split_tracks(n, seed, val=0.1, test=0.1):
    idx = np.random.default_rng(seed).permutation(n)
    n_val, n_test = int(n * val), int(n * test)
    return idx[n_val + n_test:], idx[:n_val], idx[n_val:n_val + n_test]


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    ys, ps = [], []
    for x, y, lengths in loader:
        logits = model(x.to(device), lengths)
        m = y != -100
        ps.append(logits.argmax(-1).cpu()[m].numpy())
        ys.append(y[m].numpy())
    model.train()
    y, p = np.concatenate(ys), np.concatenate(ps)
    prec, rec, f1, _ = precision_recall_fscore_support(y, p, average="binary", zero_division=0)
    return {"f1": f1, "precision": prec, "recall": rec, "macro_f1": f1_score(y, p, average="macro")}


def main():
    args = get_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    n_gpu = torch.cuda.device_count()

    z = np.load(args.data, allow_pickle=True)
    feats, labels = list(z["features"]), list(z["labels"])
    tr, va, te = split_tracks(len(feats), args.seed)
    stacked = np.concatenate([feats[i] for i in tr])
    mean, std = stacked.mean(0), stacked.std(0) + 1e-6

    def subset(ids):
        return TrackDataset([feats[i] for i in ids], [labels[i] for i in ids], args.max_len, mean, std)

    train_dl = DataLoader(subset(tr), batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(subset(va), batch_size=args.batch_size, collate_fn=collate, num_workers=2)
    test_dl = DataLoader(subset(te), batch_size=args.batch_size, collate_fn=collate, num_workers=2)

    stay_frac = np.concatenate([labels[i] for i in tr]).mean()
    class_w = torch.tensor([1.0 / (1 - stay_frac), 1.0 / stay_frac], device=device)
    class_w = class_w / class_w.sum() * 2

    model = StayPointTagger(len(FEATURES), args.hidden, args.layers).to(device)
    if n_gpu > 1:
        model = nn.DataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=2)
    os.makedirs(args.out, exist_ok=True)
    log.info("gpus=%d tracks train/val/test=%d/%d/%d stay_frac=%.3f", n_gpu, len(tr), len(va), len(te), stay_frac)

    best, bad = -1.0, 0
    for epoch in range(args.epochs):
        t0 = time.time()
        total, n = 0.0, 0
        for x, y, lengths in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x, lengths)
            loss = F.cross_entropy(logits.reshape(-1, 2), y.reshape(-1), weight=class_w, ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            total += loss.item()
            n += 1
        metrics = run_eval(model, val_dl, device)
        sched.step(metrics["f1"])
        log.info("epoch %d loss %.4f val f1 %.4f P %.4f R %.4f (%.0fs)", epoch, total / max(n, 1),
                 metrics["f1"], metrics["precision"], metrics["recall"], time.time() - t0)
        if metrics["f1"] > best:
            best, bad = metrics["f1"], 0
            state = model.module.state_dict() if isinstance(model, nn.DataParallel) else model.state_dict()
            torch.save({"model": state, "mean": mean, "std": std, "epoch": epoch},
                       os.path.join(args.out, "best.pt"))
        else:
            bad += 1
            if bad >= args.patience:
                log.info("early stop at epoch %d", epoch)
                break

    ck = torch.load(os.path.join(args.out, "best.pt"), map_location=device, weights_only=False)
    target = model.module if isinstance(model, nn.DataParallel) else model
    target.load_state_dict(ck["model"])
    log.info("test %s", run_eval(model, test_dl, device))


if __name__ == "__main__":
    main()
