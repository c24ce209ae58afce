"""Per-minute sleep apnea detection from single-lead ECG (PhysioNet Apnea-ECG database).

The 35 released recordings (a01-a20, b01-b05, c01-c10) have one label per minute
(A = apnea/hypopnea, N = normal). Each sample is the labelled minute plus two minutes of
context on each side (5 min @ 100 Hz), band-passed 3-45 Hz and z-scored per recording.

Recording-wise 5-fold CV (each recording is a different subject); --fold = held-out fold.

    torchrun --nproc_per_node=4 14_apnea_ecg_minute_cnn.py --db /data/apnea-ecg --fold 4
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wfdb
from scipy.signal import butter, sosfiltfilt
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RECORDS = [f"a{i:02d}" for i in range(1, 21)] + [f"b{i:02d}" for i in range(1, 6)] + [f"c{i:02d}" for i in range(1, 11)]
FS = 100
CONTEXT_MIN = 2


def get_args():
    p = argparse.ArgumentParser(description="Apnea-ECG minute classifier")
    p.add_argument("--db", required=True)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--out", default="runs/apnea")
    p.add_argument("--seed", type=int, default=99)
    return p.parse_args()


class ApneaMinutes(Dataset):
    def __init__(self, db, records):
        sos = butter(4, [3, 45], btype="band", fs=FS, output="sos")
        self.signals, self.index, self.labels = [], [], []
        span = 60 * FS
        for r, rec in enumerate(records):
            sig = wfdb.rdrecord(os.path.join(db, rec)).p_signal[:, 0]
            sig = sosfiltfilt(sos, sig).astype(np.float32)
            sig = (sig - np.median(sig)) / (np.std(sig) + 1e-6)
            ann = wfdb.rdann(os.path.join(db, rec), "apn")
            self.signals.append(sig)
            for minute, sym in enumerate(ann.symbol):
                s = (minute - CONTEXT_MIN) * span
                e = (minute + CONTEXT_MIN + 1) * span
                if s < 0 or e > len(sig):
                    continue
                self.index.append((r, s))
                self.labels.append(1 if sym == "A" else 0)
        self.length = (2 * CONTEXT_MIN + 1) * span

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        r, s = self.index[i]
        return torch.from_numpy(self.signals[r][s:s + self.length].copy())[None], self.labels[i]


class SEBlock(nn.Module):
    def __init__(self, c, r=8):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(c, c // r), nn.ReLU(), nn.Linear(c // r, c), nn.Sigmoid())

    def forward(self, x):
        return x * self.fc(x.mean(-1)).unsqueeze(-1)


class ApneaNet(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = [(1, 32, 11, 4), (32, 64, 9, 4), (64, 96, 7, 4), (96, 128, 5, 2), (128, 128, 5, 2)]
        layers = []
        for cin, cout, k, pool in cfg:
            layers += [nn.Conv1d(cin, cout, k, padding=k // 2), nn.BatchNorm1d(cout), nn.ReLU(), SEBlock(cout),
                       nn.MaxPool1d(pool)]
        self.cnn = nn.Sequential(*layers)
        self.lstm = nn.LSTM(128, 64, batch_first=True, bidirectional=True)
        self.head = nn.Sequential(nn.Dropout(0.4), nn.Linear(128, 2))

    def forward(self, x):
        h, _ = self.lstm(self.cnn(x).transpose(1, 2))
        return self.head(h.mean(1))


@torch.no_grad()
def evaluate(model, loader, n, device):
    model.eval()
    probs, labels = [], []
    for x, y in loader:
        probs.append(F.softmax(model(x.to(device, non_blocking=True)), 1)[:, 1])
        labels.append(y.to(device, non_blocking=True))
    probs, labels = torch.cat(probs), torch.cat(labels)
    W = dist.get_world_size()
    gp, gl = [torch.zeros_like(probs) for _ in range(W)], [torch.zeros_like(labels) for _ in range(W)]
    dist.all_gather(gp, probs)
    dist.all_gather(gl, labels)
    p = torch.stack(gp, 1).reshape(-1)[:n].cpu().numpy()
    y = torch.stack(gl, 1).reshape(-1)[:n].cpu().numpy()
    pred = (p > 0.5).astype(int)
    return {"auroc": roc_auc_score(y, p), "f1": f1_score(y, pred), "acc": float((pred == y).mean()),
            "sens": float(pred[y == 1].mean()), "spec": float(1 - pred[y == 0].mean())}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    log = logging.getLogger("apnea")
    torch.manual_seed(args.seed)

    order = np.random.RandomState(args.seed).permutation(len(RECORDS))
    folds = np.array_split(order, args.n_folds)
    test_recs = [RECORDS[i] for i in folds[args.fold]]
    val_recs = [RECORDS[i] for i in folds[(args.fold + 1) % args.n_folds]]
    train_recs = [r for r in RECORDS if r not in test_recs and r not in val_recs]
    train_ds, val_ds, test_ds = (ApneaMinutes(args.db, r) for r in (train_recs, val_recs, test_recs))
    log.info("minutes: train %d (%.1f%% apnea) val %d test %d", len(train_ds),
             100 * np.mean(train_ds.labels), len(val_ds), len(test_ds))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)
    test_dl = DataLoader(test_ds, 256, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=4)

    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(ApneaNet()).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.3)
    frac = float(np.mean(train_ds.labels))
    weight = torch.tensor([1.0 / (1 - frac), 1.0 / frac], device=device) / 2

    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, f"apnea_fold{args.fold}.pt")
    best, wait = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running_loss, correct, seen = 0.0, 0, 0
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y, weight=weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running_loss += loss.item() * y.size(0)
            correct += (logits.argmax(1) == y).sum().item()
            seen += y.size(0)
        sched.step()
        totals = torch.tensor([running_loss, correct, seen], dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        train_loss, train_acc = (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()

        m = evaluate(model, val_dl, len(val_ds), device)
        log.info("epoch %d loss %.4f acc %.4f | val AUROC %.4f F1 %.4f sens %.3f spec %.3f",
                 epoch, train_loss, train_acc, m["auroc"], m["f1"], m["sens"], m["spec"])
        if m["auroc"] > best:
            best, wait = m["auroc"], 0
            if rank == 0:
                torch.save(model.module.state_dict(), best_path)
        else:
            wait += 1
            if wait >= args.patience:
                log.info("early stop at epoch %d", epoch)
                break

    dist.barrier()
    model.module.load_state_dict(torch.load(best_path, map_location=device))
    m = evaluate(model, test_dl, len(test_ds), device)
    log.info("fold %d TEST AUROC %.4f F1 %.4f acc %.4f sens %.3f spec %.3f",
             args.fold, m["auroc"], m["f1"], m["acc"], m["sens"], m["spec"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
