"""Skimming / compromised-terminal detection: LSTM autoencoder over hourly terminal activity.

Trained on windows from terminals with no confirmed compromise; the anomaly score of a
window is its reconstruction error. Validation windows carry the compromise label from
the common-point-of-purchase investigations, so we report PR-AUC on them.

    torchrun --nproc_per_node=4 16_terminal_lstm_autoencoder.py --windows /data/terminals/windows_168h
    torchrun --nproc_per_node=4 16_terminal_lstm_autoencoder.py --windows /data/terminals/windows_168h \
        --resume runs/term_ae/last.pt
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("term_ae")


class Windows(Dataset):
    """windows.npy [N, T, F]: per-hour counts, declines, distinct cards, mean amount, chip-fallback rate..."""

    def __init__(self, root, split, mean=None, std=None):
        self.x = np.load(os.path.join(root, f"{split}_windows.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(root, f"{split}_labels.npy")) if split != "train" else None
        if mean is None:
            sample = np.asarray(self.x[:: max(1, len(self.x) // 50000)], dtype=np.float32)
            sample = np.log1p(sample)
            mean, std = sample.mean((0, 1)), sample.std((0, 1)) + 1e-6
        self.mean, self.std = mean.astype(np.float32), std.astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        w = (np.log1p(np.asarray(self.x[i], dtype=np.float32)) - self.mean) / self.std
        label = -1.0 if self.y is None else float(self.y[i])
        return torch.from_numpy(w), torch.tensor(label)


class LSTMAutoencoder(nn.Module):
    def __init__(self, n_feat, hidden=128, latent=32, layers=2, dropout=0.1):
        super().__init__()
        self.encoder = nn.LSTM(n_feat, hidden, layers, batch_first=True, dropout=dropout)
        self.to_latent = nn.Linear(hidden, latent)
        self.from_latent = nn.Linear(latent, hidden)
        self.decoder = nn.LSTM(hidden, hidden, layers, batch_first=True, dropout=dropout)
        self.out = nn.Linear(hidden, n_feat)

    def forward(self, x):
        _, (h, _) = self.encoder(x)
        z = self.to_latent(h[-1])
        dec_in = self.from_latent(z).unsqueeze(1).expand(-1, x.size(1), -1)
        y, _ = self.decoder(dec_in)
        return self.out(y)


def recon_error(model, x):
    return ((model(x) - x) ** 2).mean(dim=(1, 2))


@torch.no_grad()
def validate(model, loader, device, world):
    model.eval()
    errs, labels = [], []
    for x, y in loader:
        errs.append(recon_error(model.module, x.to(device, non_blocking=True)).cpu())
        labels.append(y)
    mine = (torch.cat(errs).numpy(), torch.cat(labels).numpy())
    allp = [None] * world
    dist.all_gather_object(allp, mine)
    e = np.concatenate([a[0] for a in allp])
    y = np.concatenate([a[1] for a in allp])
    return float(average_precision_score(y, e)), float(roc_auc_score(y, e)), float(y.mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", required=True)
    ap.add_argument("--out", default="runs/term_ae")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--latent", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(0)

    train_ds = Windows(args.windows, "train")
    val_ds = Windows(args.windows, "val", train_ds.mean, train_ds.std)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_idx = np.arange(rank, len(val_ds), world)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1024, num_workers=args.workers)

    model = LSTMAutoencoder(train_ds.x.shape[-1], args.hidden, args.latent).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=3)

    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best_ap = ckpt["epoch"] + 1, ckpt["best_ap"]
        log.info("resumed from %s at epoch %d (best AP %.4f)", args.resume, start_epoch, best_ap)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, _ in train_dl:
            x = x.to(device, non_blocking=True)
            loss = recon_error(model, x).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tot += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
        dist.all_reduce(tot)

        ap_score, auc, base = validate(model, val_dl, device, world)
        sched.step(ap_score)
        if rank == 0:
            log.info("epoch %d recon %.5f | val PR-AUC %.4f (base %.4f) ROC-AUC %.4f | lr %.1e | %.0fs",
                     epoch, (tot[0] / tot[1]).item(), ap_score, base, auc, opt.param_groups[0]["lr"],
                     time.time() - t0)
            best_ap = max(best_ap, ap_score)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best_ap": best_ap,
                     "mean": torch.from_numpy(train_ds.mean), "std": torch.from_numpy(train_ds.std)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if ap_score == best_ap:
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
