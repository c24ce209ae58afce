"""Window-level seizure detection on the TUH EEG Seizure Corpus (TUSZ v2) with a
convolutional stem + transformer encoder.

Preprocessed layout (tusz_to_npz.py): one file per EDF session,
    {root}/{patient}/{session}.npz  eeg [20, T] float16 (TCP montage, 200 Hz, 0.5-70 Hz band-pass)
                                    seiz [T] uint8
Cross-validation folds are built over patients (hash of patient id modulo n_folds)
so that they are stable across machines and runs.

    torchrun --nproc_per_node=8 08_tusz_seizure_transformer.py --root /data/tusz_npz --fold 0
"""
import argparse
import glob
import hashlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FS = 200


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="runs/tusz")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--win_s", type=int, default=12)
    p.add_argument("--hop_s", type=int, default=3)
    p.add_argument("--d_model", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def patient_fold(patient, n_folds):
    return int(hashlib.md5(patient.encode()).hexdigest(), 16) % n_folds


class TUSZWindows(Dataset):
    def __init__(self, files, win, hop):
        self.files = files
        self.win = win
        self.items, self.labels = [], []
        for fi, f in enumerate(files):
            with np.load(f) as d:
                seiz = d["seiz"]
            for s in range(0, len(seiz) - win + 1, hop):
                self.items.append((fi, s))
                self.labels.append(int(seiz[s:s + win].any()))
        self._cache = {}

    def __len__(self):
        return len(self.items)

    def _load(self, fi):
        # small per-worker cache: consecutive indices usually hit the same session
        if fi not in self._cache:
            if len(self._cache) > 16:
                self._cache.pop(next(iter(self._cache)))
            self._cache[fi] = np.load(self.files[fi])["eeg"]
        return self._cache[fi]

    def __getitem__(self, i):
        fi, s = self.items[i]
        x = self._load(fi)[:, s:s + self.win].astype(np.float32)
        x = np.clip(x / 100.0, -10, 10)  # uV -> roughly unit scale
        return torch.from_numpy(x), torch.tensor(self.labels[i], dtype=torch.float32)


class EEGTransformer(nn.Module):
    def __init__(self, n_ch=20, d=192, layers=6, heads=6, max_tokens=256):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv1d(n_ch, d // 2, 7, 2, 3), nn.GELU(),
            nn.Conv1d(d // 2, d, 7, 2, 3), nn.GELU(),
            nn.Conv1d(d, d, 5, 5), nn.GELU(),
        )  # 200 Hz -> 10 tokens / s
        self.pos = nn.Parameter(torch.randn(1, max_tokens, d) * 0.02)
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.stem(x).transpose(1, 2)
        h = h + self.pos[:, : h.size(1)]
        h = self.norm(self.encoder(h))
        return self.out(h.mean(1)).squeeze(-1)


@torch.no_grad()
def predict(model, loader, n, device, amp):
    model.eval()
    ps, ys = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = model(x.to(device, non_blocking=True))
        ps.append(torch.sigmoid(logits.float()))
        ys.append(y.to(device))
    ps, ys = torch.cat(ps), torch.cat(ys)
    W = dist.get_world_size()
    all_p, all_y = [torch.zeros_like(ps) for _ in range(W)], [torch.zeros_like(ys) for _ in range(W)]
    dist.all_gather(all_p, ps)
    dist.all_gather(all_y, ys)
    return torch.stack(all_p, 1).flatten()[:n].cpu().numpy(), torch.stack(all_y, 1).flatten()[:n].cpu().numpy()


def metrics(p, y):
    return {"auroc": roc_auc_score(y, p), "f1": f1_score(y.astype(int), (p > 0.5).astype(int))}


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.root, "*", "*.npz")))
    fold_of = {f: patient_fold(os.path.basename(os.path.dirname(f)), args.n_folds) for f in files}
    val_fold = (args.fold + 1) % args.n_folds
    train_files = [f for f in files if fold_of[f] not in (args.fold, val_fold)]
    val_files = [f for f in files if fold_of[f] == val_fold]
    test_files = [f for f in files if fold_of[f] == args.fold]

    win, hop = args.win_s * FS, args.hop_s * FS
    train_ds = TUSZWindows(train_files, win, hop)
    val_ds, test_ds = TUSZWindows(val_files, win, win), TUSZWindows(test_files, win, win)
    pos = float(np.mean(train_ds.labels))

    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    tr_loader = DataLoader(train_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, pin_memory=True,
                           drop_last=True, persistent_workers=True)
    va_loader = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, shuffle=False),
                           num_workers=args.workers, pin_memory=True)
    te_loader = DataLoader(test_ds, 256, sampler=DistributedSampler(test_ds, shuffle=False),
                           num_workers=args.workers, pin_memory=True)

    model = EEGTransformer(d=args.d_model, layers=args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(tr_loader), eta_min=1e-6)
    pos_weight = torch.tensor(min((1 - pos) / pos, 30.0), device=device)

    out_dir = os.path.join(args.out, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"train {len(train_ds)} windows ({pos:.2%} seizure) | val {len(val_ds)} | test {len(test_ds)}")
    best_auc, epochs_no_improve = 0.0, 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(tr_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"  ep {epoch} step {step}/{len(tr_loader)} loss {loss.item():.4f}", flush=True)

        p, y = predict(model, va_loader, len(val_ds), device, args.amp)
        if rank == 0:
            m = metrics(p, y)
            print(f"epoch {epoch} val AUROC {m['auroc']:.4f} F1 {m['f1']:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if m["auroc"] > best_auc:
                best_auc, epochs_no_improve = m["auroc"], 0
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pt"))
            else:
                epochs_no_improve += 1
                if epochs_no_improve >= args.patience:
                    print(f"early stopping after epoch {epoch}")
                    break

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(out_dir, "best.pt"), map_location=device))
    p, y = predict(model, te_loader, len(test_ds), device, args.amp)
    if rank == 0:
        m = metrics(p, y)
        print(f"fold {args.fold} TEST AUROC {m['auroc']:.4f} F1 {m['f1']:.4f}")
        np.savez(os.path.join(out_dir, "test_preds.npz"), p=p, y=y)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
