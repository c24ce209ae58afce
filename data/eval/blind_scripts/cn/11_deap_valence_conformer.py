"""Cross-subject valence classification (high vs. low, threshold 5) on DEAP.

Uses the preprocessed python release (s01.dat ... s32.dat, 40 trials x 40 channels x 8064
samples @128 Hz; the first 3 s are the pre-trial baseline). Only the 32 EEG channels are used.
Baseline removal: subtract the mean of the 3 s baseline per channel. Trials are cut into
4 s windows with a 2 s hop; every window inherits the trial's label.

Subject-wise 8-fold CV (4 subjects per fold), --fold picks the held-out subjects.

    torchrun --standalone --nproc_per_node=4 11_deap_valence_conformer.py --deap_dir /data/deap/data_preprocessed_python --fold 5
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import accuracy_score, f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

FS = 128
N_SUBJECTS = 32


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--deap_dir", required=True)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=8)
    p.add_argument("--win_s", type=int, default=4)
    p.add_argument("--hop_s", type=int, default=2)
    p.add_argument("--emb", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--patience", type=int, default=15)
    p.add_argument("--save_dir", default="./weights/deap")
    p.add_argument("--seed", type=int, default=3407)
    return p.parse_args()


def load_subject(deap_dir, sid, win, hop):
    with open(os.path.join(deap_dir, f"s{sid:02d}.dat"), "rb") as f:
        d = pickle.load(f, encoding="latin1")
    eeg = d["data"][:, :32, :].astype(np.float32)
    base = eeg[:, :, : 3 * FS].mean(axis=2, keepdims=True)
    eeg = eeg[:, :, 3 * FS:] - base
    eeg = (eeg - eeg.mean(axis=(0, 2), keepdims=True)) / (eeg.std(axis=(0, 2), keepdims=True) + 1e-6)
    valence = (d["labels"][:, 0] > 5).astype(np.int64)
    xs, ys = [], []
    for trial, lab in zip(eeg, valence):
        for s in range(0, trial.shape[1] - win + 1, hop):
            xs.append(trial[:, s:s + win])
            ys.append(lab)
    return np.stack(xs), np.asarray(ys)


def subject_split(fold, n_folds):
    subjects = np.arange(1, N_SUBJECTS + 1)
    folds = np.array_split(subjects, n_folds)
    test = folds[fold]
    val = folds[(fold + 1) % n_folds]
    train = np.setdiff1d(subjects, np.concatenate([test, val]))
    return train, val, test


def dataset_for(args, subjects):
    parts = [load_subject(args.deap_dir, s, args.win_s * FS, args.hop_s * FS) for s in subjects]
    x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return TensorDataset(x, y)


class PatchEmbed(nn.Module):
    """Temporal conv -> spatial conv over all electrodes -> pooling (ShallowConvNet style)."""

    def __init__(self, n_ch, emb):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 40, (1, 25), (1, 1)),
            nn.Conv2d(40, 40, (n_ch, 1), (1, 1)),
            nn.GroupNorm(8, 40), nn.ELU(),
            nn.AvgPool2d((1, 32), (1, 8)),
            nn.Dropout(0.5),
            nn.Conv2d(40, emb, (1, 1)),
        )

    def forward(self, x):
        return self.net(x.unsqueeze(1)).squeeze(2).transpose(1, 2)  # [B, tokens, emb]


class EEGConformer(nn.Module):
    def __init__(self, n_ch=32, emb=64, depth=4, heads=8, n_classes=2):
        super().__init__()
        self.embed = PatchEmbed(n_ch, emb)
        layer = nn.TransformerEncoderLayer(emb, heads, emb * 4, 0.3, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.head = nn.Sequential(nn.LayerNorm(emb), nn.Linear(emb, 32), nn.ELU(), nn.Dropout(0.3),
                                  nn.Linear(32, n_classes))

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


@torch.no_grad()
def predict_all(model, loader, device):
    model.eval()
    P, Y = [], []
    for x, y in loader:
        P.append(model(x.to(device)).softmax(-1)[:, 1].cpu())
        Y.append(y)
    return torch.cat(P).numpy(), torch.cat(Y).numpy()


@torch.no_grad()
def val_metrics(model, loader, n, device):
    model.eval()
    p, y = [], []
    for x, t in loader:
        p.append(model(x.to(device, non_blocking=True)).softmax(-1)[:, 1])
        y.append(t.to(device, non_blocking=True))
    p, y = torch.cat(p), torch.cat(y)
    ws = dist.get_world_size()
    gp, gy = [torch.empty_like(p) for _ in range(ws)], [torch.empty_like(y) for _ in range(ws)]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    p = torch.stack(gp, 1).flatten()[:n].cpu().numpy()
    y = torch.stack(gy, 1).flatten()[:n].cpu().numpy()
    return roc_auc_score(y, p), f1_score(y, p > 0.5)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    tr_s, va_s, te_s = subject_split(args.fold, args.n_folds)
    train_ds, val_ds = dataset_for(args, tr_s), dataset_for(args, va_s)
    if rank == 0:
        print(f"fold {args.fold}: train subjects {tr_s.tolist()} val {va_s.tolist()} test {te_s.tolist()}")
        print(f"windows: train {len(train_ds)} val {len(val_ds)}; "
              f"high-valence share {train_ds.tensors[1].float().mean():.3f}")

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=512, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, pin_memory=True)

    model = EEGConformer(emb=args.emb, depth=args.depth).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.999))
    criterion = nn.CrossEntropyLoss()

    os.makedirs(args.save_dir, exist_ok=True)
    best_file = os.path.join(args.save_dir, f"conformer_fold{args.fold}.pth")
    best_auc, wait = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # channel-wise amplitude jitter
            x = x * (1 + 0.1 * torch.randn(x.size(0), x.size(1), 1, device=device))
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        auc, f1 = val_metrics(model, val_loader, len(val_ds), device)
        if rank == 0:
            print(f"[{epoch:03d}] loss {loss.item():.4f} val AUROC {auc:.4f} F1 {f1:.4f} {time.time() - t0:.1f}s",
                  flush=True)
        if auc > best_auc:
            best_auc, wait = auc, 0
            if rank == 0:
                torch.save(model.state_dict(), best_file)
        else:
            wait += 1
            if wait >= args.patience:
                break

    dist.barrier()
    if rank == 0:
        # final test on the held-out subjects with the best checkpoint, single process
        test_ds = dataset_for(args, te_s)
        test_loader = DataLoader(test_ds, batch_size=512, shuffle=False, num_workers=4)
        best_model = EEGConformer(emb=args.emb, depth=args.depth).to(device)
        best_model.load_state_dict(torch.load(best_file, map_location=device))
        p, y = predict_all(best_model, test_loader, device)
        print(f"fold {args.fold} TEST acc {accuracy_score(y, p > 0.5):.4f} F1 {f1_score(y, p > 0.5):.4f} "
              f"AUROC {roc_auc_score(y, p):.4f} (best val AUROC {best_auc:.4f})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
