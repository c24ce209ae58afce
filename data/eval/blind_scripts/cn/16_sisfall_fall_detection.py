"""Fall detection on SisFall (waist-worn ADXL345 + MMA8451Q accelerometers, ITG3200 gyro, 200 Hz).

Every trial file (e.g. SA01/F05_SA01_R02.txt) is one recording; F** codes are falls, D** codes
are activities of daily living. Recordings are cut into 3 s windows (hop 0.5 s). A window from
a fall trial is positive when it contains the impact (peak acceleration magnitude of the trial);
all other windows are negative, so positives are ~3 % of the windows.

Subject-wise 5-fold CV over the 38 subjects (young SA** and elderly SE**).

    torchrun --nproc_per_node=4 16_sisfall_fall_detection.py --root /data/SisFall_dataset --fold 1
"""
import argparse
import glob
import os
import re

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, precision_recall_curve, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FS = 200
# sensor scaling to g / deg/s as given in the SisFall readme
ADXL = (2 * 16) / 2 ** 13
ITG = (2 * 2000) / 2 ** 16
MMA = (2 * 8) / 2 ** 14


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--save_dir", default="checkpoints/sisfall")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--n_folds", type=int, default=5)
    ap.add_argument("--win_s", type=float, default=3.0)
    ap.add_argument("--hop_s", type=float, default=0.5)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--focal_gamma", type=float, default=2.0)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--seed", type=int, default=8)
    return ap.parse_args()


def read_trial(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip().rstrip(";")
            if line:
                rows.append([float(v) for v in line.split(",")])
    a = np.asarray(rows, dtype=np.float32)
    acc1 = a[:, 0:3] * ADXL
    gyr = a[:, 3:6] * ITG / 100.0
    acc2 = a[:, 6:9] * MMA
    return np.concatenate([acc1, gyr, acc2], axis=1).T  # [9, T]


class SisFallWindows(Dataset):
    def __init__(self, root, subjects, win, hop):
        self.x, self.y = [], []
        for subj in subjects:
            for path in sorted(glob.glob(os.path.join(root, subj, "*.txt"))):
                code = os.path.basename(path).split("_")[0]
                sig = read_trial(path)
                impact = int(np.argmax(np.linalg.norm(sig[0:3], axis=0))) if code.startswith("F") else -1
                for s in range(0, sig.shape[1] - win + 1, hop):
                    self.x.append(sig[:, s:s + win])
                    self.y.append(int(s <= impact < s + win))
        self.x = np.stack(self.x).astype(np.float32)
        self.y = np.asarray(self.y, dtype=np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), torch.tensor(self.y[i])


class AttnPool(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h):  # h [B, T, D]
        w = torch.softmax(self.score(h), dim=1)
        return (w * h).sum(1)


class FallNet(nn.Module):
    def __init__(self, in_ch=9, d=128):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(in_ch, 64, 9, padding=4), nn.BatchNorm1d(64), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(64, 128, 7, padding=3), nn.BatchNorm1d(128), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(128, d, 5, padding=2), nn.BatchNorm1d(d), nn.ReLU(), nn.MaxPool1d(2),
        )
        self.pool = AttnPool(d)
        self.out = nn.Sequential(nn.Dropout(0.3), nn.Linear(d, 1))

    def forward(self, x):
        return self.out(self.pool(self.conv(x).transpose(1, 2))).squeeze(-1)


def focal_bce(logits, y, gamma, alpha=0.75):
    bce = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
    p_t = torch.exp(-bce)
    a_t = alpha * y + (1 - alpha) * (1 - y)
    return (a_t * (1 - p_t) ** gamma * bce).mean()


@torch.no_grad()
def gather_scores(model, loader, n, device):
    model.eval()
    s, t = [], []
    for x, y in loader:
        s.append(torch.sigmoid(model(x.to(device, non_blocking=True))))
        t.append(y.to(device, non_blocking=True))
    s, t = torch.cat(s), torch.cat(t)
    W = dist.get_world_size()
    gs, gt = [torch.empty_like(s) for _ in range(W)], [torch.empty_like(t) for _ in range(W)]
    dist.all_gather(gs, s)
    dist.all_gather(gt, t)
    return torch.stack(gs, 1).flatten()[:n].cpu().numpy(), torch.stack(gt, 1).flatten()[:n].cpu().numpy()


def summarize(p, y, thr=None):
    if thr is None:
        prec, rec, thr_grid = precision_recall_curve(y, p)
        f1s = 2 * prec * rec / np.clip(prec + rec, 1e-8, None)
        thr = float(thr_grid[np.argmax(f1s[:-1])])
    return {"auroc": float(roc_auc_score(y, p)), "f1": float(f1_score(y, p >= thr)), "thr": thr}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    subjects = sorted(d for d in os.listdir(args.root) if re.fullmatch(r"S[AE]\d\d", d))
    perm = np.random.RandomState(args.seed).permutation(len(subjects))
    folds = [sorted(subjects[i] for i in f) for f in np.array_split(perm, args.n_folds)]
    test_s, val_s = folds[args.fold], folds[(args.fold + 1) % args.n_folds]
    train_s = [s for s in subjects if s not in test_s and s not in val_s]

    win, hop = int(args.win_s * FS), int(args.hop_s * FS)
    train_ds = SisFallWindows(args.root, train_s, win, hop)
    val_ds = SisFallWindows(args.root, val_s, win, hop)
    test_ds = SisFallWindows(args.root, test_s, win, hop)
    if rank == 0:
        print(f"fold {args.fold}: windows train {len(train_ds)} ({train_ds.y.mean():.2%} falls) "
              f"val {len(val_ds)} test {len(test_ds)}", flush=True)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 512, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)
    test_dl = DataLoader(test_ds, 512, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=2)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(FallNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=3, factor=0.5)

    os.makedirs(args.save_dir, exist_ok=True)
    best_path = os.path.join(args.save_dir, f"fallnet_fold{args.fold}_best.pt")
    best_auc, stale = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        epoch_loss = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = focal_bce(model(x), y, args.focal_gamma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            epoch_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(epoch_loss)

        p, y = gather_scores(model, val_dl, len(val_ds), device)
        val = summarize(p, y)
        sched.step(val["auroc"])
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(epoch_loss[0] / epoch_loss[1]).item():.4f} "
                  f"val AUROC {val['auroc']:.4f} F1 {val['f1']:.4f} @thr {val['thr']:.3f}", flush=True)
        if val["auroc"] > best_auc:
            best_auc, stale = val["auroc"], 0
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "thr": val["thr"]}, best_path)
        else:
            stale += 1
            if stale >= args.patience:
                break

    dist.barrier()
    ckpt = torch.load(best_path, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    p, y = gather_scores(model, test_dl, len(test_ds), device)
    test = summarize(p, y, thr=ckpt["thr"])  # threshold chosen on validation
    if rank == 0:
        print(f"fold {args.fold} (epoch {ckpt['epoch']}) TEST AUROC {test['auroc']:.4f} F1 {test['f1']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
