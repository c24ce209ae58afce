"""Reconstruction-based anomaly detection for compressor telemetry.

Multivariate sliding windows -> patch transformer autoencoder -> per-window
anomaly score. The threshold is picked on the (labelled) validation span and
then applied to the test span.

Launch:
    torchrun --nnodes=1 --nproc_per_node=8 02_recon_anomaly_compressor.py --cfg configs/compressor.yaml
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from sklearn.metrics import precision_recall_fscore_support
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    data="/data/shared/compressor/telemetry.npz",
    out="checkpoints/compressor_ad",
    win=128, step_train=4, step_eval=1, patch=8,
    d_model=96, heads=4, layers=3, dropout=0.1,
    batch=256, epochs=20, lr=3e-4, wd=1e-5, workers=4,
    seed=7,
)


class Windows(Dataset):
    def __init__(self, x, labels, win, step):
        self.x, self.labels, self.win = x, labels, win
        self.starts = np.arange(0, len(x) - win + 1, step)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        w = torch.from_numpy(self.x[s:s + self.win])
        lab = int(self.labels[s:s + self.win].max()) if self.labels is not None else 0
        return i, w, lab


class PatchAE(nn.Module):
    def __init__(self, n_ch, win, patch, d_model, heads, layers, dropout):
        super().__init__()
        self.patch = patch
        n_tok = win // patch
        self.inp = nn.Linear(n_ch * patch, d_model)
        self.pos = nn.Parameter(torch.zeros(1, n_tok, d_model))
        self.bn_in = nn.BatchNorm1d(d_model)
        enc = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout, batch_first=True)
        self.enc = nn.TransformerEncoder(enc, layers)
        self.out = nn.Linear(d_model, n_ch * patch)

    def forward(self, x):  # (B, W, C)
        B, W, C = x.shape
        tok = x.reshape(B, W // self.patch, self.patch * C)
        z = self.inp(tok)
        z = self.bn_in(z.transpose(1, 2)).transpose(1, 2) + self.pos
        z = self.enc(z)
        return self.out(z).reshape(B, W, C)


def gather_scores(idx, scores, labels, world):
    """all_gather variable-length (index, score, label) triples from every rank."""
    n = torch.tensor([idx.numel()], device=idx.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    payload = torch.full((max_n, 3), -1.0, device=idx.device, dtype=torch.float64)
    payload[: idx.numel(), 0] = idx.double()
    payload[: idx.numel(), 1] = scores.double()
    payload[: idx.numel(), 2] = labels.double()
    bufs = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(bufs, payload)
    rows = torch.cat([b[: int(s.item())] for b, s in zip(bufs, sizes)]).cpu().numpy()
    # DistributedSampler pads the last rank by repeating indices; keep one copy each
    _, keep = np.unique(rows[:, 0], return_index=True)
    rows = rows[keep]
    return rows[:, 1], rows[:, 2].astype(int)


@torch.no_grad()
def score_split(model, loader, device, world):
    model.eval()
    all_idx, all_s, all_y = [], [], []
    for idx, w, y in loader:
        w = w.to(device, non_blocking=True)
        rec = model(w)
        all_s.append((rec - w).pow(2).mean(dim=(1, 2)))
        all_idx.append(idx.to(device))
        all_y.append(y.to(device))
    model.train()
    return gather_scores(torch.cat(all_idx), torch.cat(all_s), torch.cat(all_y), world)


def best_threshold(scores, labels):
    cands = np.quantile(scores, np.linspace(0.80, 0.999, 200))
    best = (0.0, cands[-1])
    for t in cands:
        _, _, f1, _ = precision_recall_fscore_support(labels, scores > t, average="binary",
                                                      zero_division=0)
        if f1 > best[0]:
            best = (f1, t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"])

    raw = np.load(cfg["data"])
    train_x, val_x, test_x = raw["train"], raw["val"], raw["test"]
    val_y, test_y = raw["val_labels"], raw["test_labels"]
    # per-sensor statistics from the (anomaly-free) training span only
    mu, sd = train_x.mean(0), train_x.std(0) + 1e-6
    norm = lambda a: ((a - mu) / sd).astype(np.float32)
    train_ds = Windows(norm(train_x), None, cfg["win"], cfg["step_train"])
    val_ds = Windows(norm(val_x), val_y, cfg["win"], cfg["step_eval"])
    test_ds = Windows(norm(test_x), test_y, cfg["win"], cfg["step_eval"])

    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"])
    mk = lambda ds, smp, bs: DataLoader(ds, batch_size=bs, sampler=smp, num_workers=cfg["workers"],
                                        pin_memory=True)
    train_dl = mk(train_ds, tr_sampler, cfg["batch"])
    val_dl = mk(val_ds, DistributedSampler(val_ds, shuffle=False), 2 * cfg["batch"])
    test_dl = mk(test_ds, DistributedSampler(test_ds, shuffle=False), 2 * cfg["batch"])

    net = PatchAE(train_x.shape[1], cfg["win"], cfg["patch"], cfg["d_model"], cfg["heads"],
                  cfg["layers"], cfg["dropout"])
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    # cfg["batch"] is per GPU; lr in the yaml is tuned for 8 GPUs x 256
    lr = cfg["lr"] * world / 8
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg["wd"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] * len(train_dl))

    os.makedirs(cfg["out"], exist_ok=True)
    ckpt_path = os.path.join(cfg["out"], "last.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from epoch {state['epoch']}")

    for epoch in range(start_epoch, cfg["epochs"]):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for _, w, _ in train_dl:
            w = w.to(device, non_blocking=True)
            loss = (model(w) - w).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc[0] += loss.detach() * w.shape[0]
            acc[1] += w.shape[0]
        dist.all_reduce(acc)

        val_s, val_lab = score_split(model, val_dl, device, world)
        f1, thr = best_threshold(val_s, val_lab)
        if rank == 0:
            print(f"[{epoch:02d}] recon {acc[0].item() / acc[1].item():.5f} val-F1 {f1:.3f} "
                  f"thr {thr:.4f} n_val={len(val_s)} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "threshold": thr,
                        "mu": torch.from_numpy(mu), "sd": torch.from_numpy(sd)}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    # final: threshold from validation, applied unchanged on test
    val_s, val_lab = score_split(model, val_dl, device, world)
    _, thr = best_threshold(val_s, val_lab)
    test_s, test_lab = score_split(model, test_dl, device, world)
    if rank == 0:
        p, r, f1, _ = precision_recall_fscore_support(test_lab, test_s > thr, average="binary",
                                                      zero_division=0)
        print(f"TEST precision {p:.3f} recall {r:.3f} F1 {f1:.3f} (thr={thr:.4f})")
        np.save(os.path.join(cfg["out"], "test_scores.npy"), test_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
