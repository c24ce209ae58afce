"""Free-living activity recognition on Capture-24 (wrist accelerometer, Axivity AX3).

Labels follow the Walmsley2020 scheme: sleep / sedentary / light / moderate-vigorous.
Raw files P001.csv.gz ... P151.csv.gz (time, x, y, z, annotation) are resampled to 30 Hz
and cut into non-overlapping 30 s windows; windows with mixed or missing annotations are
dropped. The windowed arrays are cached because parsing the raw CSVs takes ~40 minutes.

Participant-wise GroupKFold, --fold selects the test participants.

    torchrun --nproc_per_node=4 09_capture24_har_cnn.py --raw_dir /data/capture24 --cache_dir /scratch/c24 --fold 0
"""
import argparse
import glob
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.signal import resample_poly
from sklearn.metrics import classification_report, f1_score, roc_auc_score
from sklearn.model_selection import GroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["sleep", "sedentary", "light", "moderate-vigorous"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw_dir", default="/data/capture24")
    ap.add_argument("--cache_dir", default="/scratch/c24")
    ap.add_argument("--label_scheme", default="label:Walmsley2020")
    ap.add_argument("--fs", type=int, default=30)
    ap.add_argument("--win_s", type=int, default=30)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--n_folds", type=int, default=5)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out_dir", default="runs/capture24")
    return ap.parse_args()


def window_participant(path, label_map, fs, win_s):
    df = pd.read_csv(path, usecols=["time", "x", "y", "z", "annotation"], dtype={"annotation": "string"})
    xyz = df[["x", "y", "z"]].to_numpy(np.float32)
    ann = df["annotation"].map(label_map).fillna("NA").to_numpy()
    xyz = resample_poly(xyz, fs, 100, axis=0).astype(np.float32)  # raw data are 100 Hz
    ann = ann[np.minimum((np.arange(len(xyz)) * 100) // fs, len(ann) - 1)]  # nearest original sample
    n = win_s * fs
    X, Y = [], []
    for s in range(0, len(xyz) - n + 1, n):
        lab = ann[s:s + n]
        if lab[0] == "NA" or (lab != lab[0]).any():
            continue
        X.append(xyz[s:s + n].T)
        Y.append(CLASSES.index(lab[0]))
    return np.asarray(X, np.float32).reshape(-1, 3, n), np.asarray(Y, np.int64)


def load_windows(args):
    cache = os.path.join(args.cache_dir, f"capture24_fs{args.fs}_w{args.win_s}.npz")
    if not os.path.exists(cache):
        os.makedirs(args.cache_dir, exist_ok=True)
        dictionary = pd.read_csv(os.path.join(args.raw_dir, "annotation-label-dictionary.csv"),
                                 index_col="annotation", dtype="string")
        label_map = dictionary[args.label_scheme]
        Xs, Ys, Ps = [], [], []
        for path in sorted(glob.glob(os.path.join(args.raw_dir, "P[0-9][0-9][0-9].csv.gz"))):
            pid = os.path.basename(path).split(".")[0]
            X, Y = window_participant(path, label_map, args.fs, args.win_s)
            Xs.append(X), Ys.append(Y), Ps.append(np.full(len(Y), pid))
        np.savez(cache, X=np.concatenate(Xs), Y=np.concatenate(Ys), P=np.concatenate(Ps))
    d = np.load(cache)
    return d["X"], d["Y"], d["P"]


class ResBlock(nn.Module):
    def __init__(self, c, k=5):
        super().__init__()
        self.conv1 = nn.Conv1d(c, c, k, padding=k // 2, bias=False)
        self.bn1 = nn.BatchNorm1d(c)
        self.conv2 = nn.Conv1d(c, c, k, padding=k // 2, bias=False)
        self.bn2 = nn.BatchNorm1d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class AccelResNet(nn.Module):
    def __init__(self, n_classes=4):
        super().__init__()
        chans = [3, 64, 128, 256, 256, 512]
        layers = []
        for a, b in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv1d(a, b, 5, padding=2, bias=False), nn.BatchNorm1d(b), nn.ReLU(), ResBlock(b),
                       nn.MaxPool1d(3, 2)]
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(chans[-1], n_classes))

    def forward(self, x):
        return self.fc(self.features(x))


def augment(x):
    # random 3D rotation (device orientation differs between participants) + amplitude scaling
    B = x.size(0)
    angles = (torch.rand(B, 3, device=x.device) - 0.5) * (torch.pi / 3)
    cx, cy, cz = torch.cos(angles).unbind(1)
    sx, sy, sz = torch.sin(angles).unbind(1)
    one, zero = torch.ones_like(cx), torch.zeros_like(cx)
    Rx = torch.stack([one, zero, zero, zero, cx, -sx, zero, sx, cx], 1).view(B, 3, 3)
    Ry = torch.stack([cy, zero, sy, zero, one, zero, -sy, zero, cy], 1).view(B, 3, 3)
    Rz = torch.stack([cz, -sz, zero, sz, cz, zero, zero, zero, one], 1).view(B, 3, 3)
    return (Rz @ Ry @ Rx @ x) * (0.8 + 0.4 * torch.rand(B, 1, 1, device=x.device))


@torch.no_grad()
def evaluate(model, loader, n, device):
    model.eval()
    logits, ys = [], []
    for x, y in loader:
        logits.append(model(x.to(device, non_blocking=True)).float())
        ys.append(y.to(device, non_blocking=True))
    logits, ys = torch.cat(logits), torch.cat(ys)
    W = dist.get_world_size()
    gl, gy = [torch.empty_like(logits) for _ in range(W)], [torch.empty_like(ys) for _ in range(W)]
    dist.all_gather(gl, logits)
    dist.all_gather(gy, ys)
    prob = torch.stack(gl, 1).flatten(0, 1)[:n].softmax(-1).cpu().numpy()
    y = torch.stack(gy, 1).flatten(0, 1)[:n].cpu().numpy()
    pred = prob.argmax(1)
    return {"f1": f1_score(y, pred, average="macro"), "auroc": roc_auc_score(y, prob, multi_class="ovr"),
            "pred": pred, "y": y}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    X, Y, P = load_windows(args)
    splits = list(GroupKFold(n_splits=args.n_folds).split(X, Y, groups=P))
    train_idx, test_idx = splits[args.fold]
    # validation participants: the test participants of the next fold, taken out of training
    val_idx = np.intersect1d(splits[(args.fold + 1) % args.n_folds][1], train_idx)
    train_idx = np.setdiff1d(train_idx, val_idx)

    def tds(idx):
        return TensorDataset(torch.from_numpy(X[idx]), torch.from_numpy(Y[idx]))

    train_ds, val_ds, test_ds = tds(train_idx), tds(val_idx), tds(test_idx)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    loaders = {
        "train": DataLoader(train_ds, args.batch_size, sampler=tr_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True),
        "val": DataLoader(val_ds, 512, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2),
        "test": DataLoader(test_ds, 512, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=2),
    }

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AccelResNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    counts = np.bincount(Y[train_idx], minlength=len(CLASSES))
    cw = torch.tensor(np.sqrt(counts.max() / np.maximum(counts, 1)), dtype=torch.float32, device=device)

    os.makedirs(args.out_dir, exist_ok=True)
    best_path = os.path.join(args.out_dir, f"fold{args.fold}_best.pt")
    best_f1, bad = 0.0, 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        for x, y in loaders["train"]:
            x, y = augment(x.to(device, non_blocking=True)), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=cw)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        val = evaluate(model, loaders["val"], len(val_ds), device)
        if rank == 0:
            print(f"epoch {epoch} loss(last) {loss.item():.4f} val macro-F1 {val['f1']:.4f} "
                  f"AUROC {val['auroc']:.4f}", flush=True)
        if val["f1"] > best_f1:
            best_f1, bad = val["f1"], 0
            if rank == 0:
                torch.save(model.module.state_dict(), best_path)
        else:
            bad += 1
            if bad >= args.patience:
                break

    dist.barrier()
    model.module.load_state_dict(torch.load(best_path, map_location=device))
    test = evaluate(model, loaders["test"], len(test_ds), device)
    if rank == 0:
        print(f"fold {args.fold}: test macro-F1 {test['f1']:.4f} AUROC {test['auroc']:.4f}")
        print(classification_report(test["y"], test["pred"], target_names=CLASSES, digits=3))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
