"""Multi-patient ECoG/sEEG decoding of spoken phonemes.

Electrode coverage differs for every patient, so each patient has its own
input projection (n_electrodes -> d_model); the temporal transformer and the
phoneme classifier are shared.  High-gamma envelopes (70-150 Hz, 200 Hz) were
extracted offline; per patient:

    <root>/<patient>/hg.npy       (n_trials, n_electrodes, n_times) float32
    <root>/<patient>/phoneme.npy  (n_trials,) int64   (39 ARPAbet classes)
    <root>/<patient>/fold.npy     (n_trials,) int     block-wise CV fold id

Every batch comes from a single patient (their electrodes do not line up).
"""
import argparse
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


class PatientTrials(Dataset):
    def __init__(self, root, patients, folds):
        self.items = []            # (patient_idx, X, y)
        self.offsets = []
        for p_idx, pid in enumerate(patients):
            X = np.load(Path(root) / pid / "hg.npy")
            y = np.load(Path(root) / pid / "phoneme.npy")
            fold = np.load(Path(root) / pid / "fold.npy")
            keep = np.isin(fold, folds)
            X = X[keep]
            # z-score each electrode with the patient's own statistics
            X = (X - X.mean(axis=(0, 2), keepdims=True)) / (X.std(axis=(0, 2), keepdims=True) + 1e-6)
            self.items.append((p_idx, X.astype(np.float32), y[keep]))
        self.index = [(k, i) for k, (_, X, _) in enumerate(self.items) for i in range(len(X))]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, j):
        k, i = self.index[j]
        p_idx, X, y = self.items[k]
        return torch.from_numpy(X[i]), int(y[i]), p_idx


class DistributedPatientBatchSampler(Sampler):
    """Batches never mix patients; batches are shuffled and dealt out to ranks."""

    def __init__(self, dataset, batch_size, rank, world_size, seed=0, shuffle=True):
        self.ds, self.bs = dataset, batch_size
        self.rank, self.world = rank, world_size
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0
        self.by_patient = {}
        for j, (k, _) in enumerate(dataset.index):
            self.by_patient.setdefault(k, []).append(j)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _all_batches(self):
        g = random.Random(self.seed + self.epoch)
        batches = []
        for idx in self.by_patient.values():
            idx = list(idx)
            if self.shuffle:
                g.shuffle(idx)
            batches += [idx[i:i + self.bs] for i in range(0, len(idx) - self.bs + 1, self.bs)]
        if self.shuffle:
            g.shuffle(batches)
        n = len(batches) - len(batches) % self.world
        return batches[:n]

    def __iter__(self):
        return iter(self._all_batches()[self.rank::self.world])

    def __len__(self):
        return len(self._all_batches()) // self.world


class SpeechDecoder(nn.Module):
    def __init__(self, n_electrodes, d_model=256, n_layers=4, n_heads=8, n_classes=39, max_len=512):
        super().__init__()
        self.readin = nn.ModuleList([nn.Conv1d(n, d_model, kernel_size=5, padding=2) for n in n_electrodes])
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.norm = nn.LayerNorm(d_model)
        self.cls = nn.Linear(d_model, n_classes)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x, patient):
        # x: (B, E_p, T); all samples in the batch belong to `patient`
        h = self.readin[patient](x).transpose(1, 2)
        h = h + self.pos[:, : h.size(1)]
        h = self.encoder(h)
        return self.cls(self.norm(h.mean(1)))


def cosine_warmup(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for x, y, p in loader:
        logits = model(x.to(device), int(p[0]))
        stats[0] += (logits.argmax(-1).cpu() == y).sum().item()
        stats[1] += len(y)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/ecog_speech.yaml")
    ap.add_argument("--val_fold", type=int, default=4)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    patients = sorted(cfg["patients"])
    all_folds = list(range(cfg["n_folds"]))
    train_ds = PatientTrials(cfg["root"], patients, [f for f in all_folds if f != args.val_fold])
    val_ds = PatientTrials(cfg["root"], patients, [args.val_fold])
    n_electrodes = [X.shape[1] for _, X, _ in train_ds.items]

    train_bs = DistributedPatientBatchSampler(train_ds, cfg["batch_size"], rank, world, seed=cfg.get("seed", 0))
    val_bs = DistributedPatientBatchSampler(val_ds, cfg["batch_size"], rank, world, shuffle=False)
    train_dl = DataLoader(train_ds, batch_sampler=train_bs, num_workers=4, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_sampler=val_bs, num_workers=2)

    model = SpeechDecoder(n_electrodes, d_model=cfg["d_model"], n_layers=cfg["n_layers"],
                          n_heads=cfg["n_heads"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total_steps = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_warmup(s, cfg["warmup_steps"], total_steps))

    out_dir = Path(cfg["out_dir"]) / f"valfold{args.val_fold}"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"patients={patients} electrodes={n_electrodes} steps/epoch={len(train_dl)}")

    best = 0.0
    for epoch in range(cfg["epochs"]):
        train_bs.set_epoch(epoch)
        model.train()
        for step, (x, y, p) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, int(p[0]))
                loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        acc = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val phoneme acc {acc:.4f}")
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "patients": patients,
                            "n_electrodes": n_electrodes, "cfg": cfg, "epoch": epoch},
                           out_dir / "best.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
