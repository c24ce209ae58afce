"""Normal / abnormal EEG classification on the TUH Abnormal EEG Corpus (TUAB v3).

Preprocessing (tuab_preprocess.py, braindecode-style): 21 common-average-referenced channels,
first 15 minutes after skipping the first minute, clipped to +-800 uV, resampled to 100 Hz:
    {root}/{split}/{label}/{recording_id}.npy   float16 [21, 90000]
    {root}/{split}/index.csv                    recording_id, patient_id, label
Training samples are 10 s windows (hop 5 s); the recording score is the mean window probability.

Patients of the official train split are divided into k folds (val = --fold), the official
eval split is the test set.

    torchrun --nproc_per_node=4 18_tuab_abnormal_eeg.py --root /data/tuab_pp --fold 0 --accum 2
    (add --resume runs/tuab/fold0/last.pt to continue an interrupted run)
"""
import argparse
import contextlib
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score
from sklearn.model_selection import GroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FS = 100


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out_dir", default="runs/tuab")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--win_s", type=int, default=10)
    p.add_argument("--hop_s", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=64, help="per GPU, per micro-step")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--base_lr", type=float, default=5e-4, help="for an effective batch of 256")
    p.add_argument("--warmup_epochs", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=35)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--resume", default="")
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--seed", type=int, default=20230)
    return p.parse_args()


class TUABWindows(Dataset):
    def __init__(self, root, split, recs, win, hop):
        self.paths = [os.path.join(root, split, r.label, f"{r.recording_id}.npy") for r in recs.itertuples()]
        self.rec_labels = recs["label"].map({"normal": 0, "abnormal": 1}).to_numpy()
        n_samples = 15 * 60 * FS
        starts = np.arange(0, n_samples - win + 1, hop)
        self.items = np.array([(r, s) for r in range(len(self.paths)) for s in starts])
        self.win = win

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        r, s = self.items[i]
        rec = np.load(self.paths[r], mmap_mode="r")
        x = np.asarray(rec[:, s:s + self.win], dtype=np.float32) / 50.0
        return torch.from_numpy(x), torch.tensor(self.rec_labels[r], dtype=torch.float32), i


class ConvTransformer(nn.Module):
    def __init__(self, n_ch=21, d=128, depth=4, heads=4, n_tokens=50):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv1d(n_ch, 64, 11, 2, 5), nn.GroupNorm(8, 64), nn.GELU(),
            nn.Conv1d(64, d, 9, 2, 4), nn.GroupNorm(8, d), nn.GELU(),
            nn.Conv1d(d, d, 5, 5), nn.GELU(),
        )  # 1000 samples -> 50 tokens
        self.pos = nn.Parameter(torch.zeros(1, n_tokens, d))
        nn.init.trunc_normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.stem(x).transpose(1, 2) + self.pos
        return self.head(self.norm(self.encoder(h)).mean(1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, idxs = [], []
    for x, _, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            probs.append(torch.sigmoid(model(x.to(device, non_blocking=True)).float()))
        idxs.append(idx.to(device))
    probs, idxs = torch.cat(probs), torch.cat(idxs)
    ws = dist.get_world_size()
    gp, gi = [torch.empty_like(probs) for _ in range(ws)], [torch.empty_like(idxs) for _ in range(ws)]
    dist.all_gather(gp, probs)
    dist.all_gather(gi, idxs)
    # DistributedSampler pads with repeated indices; keep one prediction per window
    idx_all, first = np.unique(torch.cat(gi).cpu().numpy(), return_index=True)
    p_win = torch.cat(gp).cpu().numpy()[first]
    ds = loader.dataset
    rec = ds.items[idx_all, 0]
    p_rec = np.bincount(rec, weights=p_win, minlength=len(ds.paths)) / np.bincount(rec, minlength=len(ds.paths))
    y_rec = ds.rec_labels
    return {
        "rec_auroc": float(roc_auc_score(y_rec, p_rec)),
        "rec_bacc": float(balanced_accuracy_score(y_rec, p_rec > 0.5)),
        "rec_f1": float(f1_score(y_rec, p_rec > 0.5)),
        "win_auroc": float(roc_auc_score(y_rec[rec], p_win)),
    }


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    is_main = rank == 0

    index = pd.read_csv(os.path.join(args.root, "train", "index.csv"))
    folds = list(GroupKFold(args.n_folds).split(index, groups=index["patient_id"]))
    tr_idx, va_idx = folds[args.fold]
    test_index = pd.read_csv(os.path.join(args.root, "eval", "index.csv"))
    win, hop = args.win_s * FS, args.hop_s * FS
    train_ds = TUABWindows(args.root, "train", index.iloc[tr_idx], win, hop)
    val_ds = TUABWindows(args.root, "train", index.iloc[va_idx], win, win)
    test_ds = TUABWindows(args.root, "eval", test_index, win, win)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=8, pin_memory=True)
    test_dl = DataLoader(test_ds, 256, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=8,
                         pin_memory=True)

    model = DDP(ConvTransformer().to(device), device_ids=[local_rank])
    eff_batch = args.batch_size * args.accum * world
    peak_lr = args.base_lr * eff_batch / 256
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(len(train_dl) / args.accum)
    total, warm = args.epochs * steps_per_epoch, int(args.warmup_epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    run_dir = os.path.join(args.out_dir, f"fold{args.fold}")
    start_epoch, best, bad = 0, 0.0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best, bad = ck["epoch"] + 1, ck["best"], ck["bad"]

    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        print(f"world {world} | effective batch {eff_batch} | peak lr {peak_lr:.2e} | "
              f"windows train {len(train_ds)} val {len(val_ds)} test {len(test_ds)}", flush=True)
    run = wandb.init(project="tuab", name=f"fold{args.fold}", config={**vars(args), "world": world},
                     resume="allow") if (is_main and args.wandb) else None

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for i, (x, y, _) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0 or (i + 1) == len(train_dl)
            # skip the gradient all-reduce on the intermediate micro-steps
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(x)
                loss = F.binary_cross_entropy_with_logits(logits.float(), y) / args.accum
                scaler.scale(loss).backward()
            if boundary:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
            loss_sum += torch.stack([loss.detach() * args.accum, torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        val = evaluate(model, val_dl, device)
        # every rank gathered the same predictions, so the early-stopping decision is identical everywhere
        improved = val["rec_auroc"] > best
        best, bad = (val["rec_auroc"], 0) if improved else (best, bad + 1)
        if is_main:
            msg = {"epoch": epoch, "train_loss": (loss_sum[0] / loss_sum[1]).item(), "lr": sched.get_last_lr()[0],
                   **{f"val/{k}": v for k, v in val.items()}}
            print(msg, flush=True)
            if run is not None:
                run.log(msg)
            if improved:
                torch.save(model.module.state_dict(), os.path.join(run_dir, "best.pt"))
            tmp = os.path.join(run_dir, "last.pt.tmp")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "best": best, "bad": bad}, tmp)
            os.replace(tmp, os.path.join(run_dir, "last.pt"))
        if bad >= args.patience:
            break

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(run_dir, "best.pt"), map_location=device))
    test = evaluate(model, test_dl, device)
    if is_main:
        print(f"fold {args.fold} TEST {test}", flush=True)
        if run is not None:
            run.summary.update({f"test/{k}": v for k, v in test.items()})
            run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
