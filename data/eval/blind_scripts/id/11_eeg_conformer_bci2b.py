"""EEG-Conformer (Song et al. 2022) on BCI IV 2b, subject-specific training.

One model per subject: sessions 01T-03T for training (last 20 % of 03T held out
for model selection), sessions 04E-05E for the final test.  Segmentation and
reconstruction (S&R) augmentation in the time domain, as in the paper.

    torchrun --nproc_per_node=2 11_eeg_conformer_bci2b.py --subject 4
"""
import argparse
import os
import time

import numpy as np
import scipy.io as sio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops.layers.torch import Rearrange
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def load_sessions(root, subject, sessions):
    X, y = [], []
    for s in sessions:
        m = sio.loadmat(os.path.join(root, f"B{subject:02d}{s}.mat"))
        X.append(m["data"].astype(np.float32))        # (trials, 3, 1000)
        y.append(m["label"].ravel().astype(np.int64) - 1)
    return np.concatenate(X), np.concatenate(y)


def segment_and_reconstruct(X, y, n_seg=8, n_aug_per_class=None, rng=None):
    """S&R: build new trials by concatenating random same-class trial segments."""
    rng = rng or np.random.default_rng()
    seg_len = X.shape[-1] // n_seg
    xs, ys = [], []
    for c in np.unique(y):
        Xc = X[y == c]
        n_aug = n_aug_per_class or len(Xc)
        picks = rng.integers(0, len(Xc), size=(n_aug, n_seg))
        aug = np.stack([np.concatenate([Xc[picks[i, j], :, j * seg_len:(j + 1) * seg_len]
                                        for j in range(n_seg)], -1) for i in range(n_aug)])
        xs.append(aug)
        ys.append(np.full(n_aug, c))
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.int64)


class PatchEmbedding(nn.Module):
    def __init__(self, n_chans, emb=40):
        super().__init__()
        self.shallow = nn.Sequential(
            nn.Conv2d(1, 40, (1, 25)), nn.Conv2d(40, 40, (n_chans, 1)),
            nn.BatchNorm2d(40), nn.ELU(), nn.AvgPool2d((1, 75), (1, 15)), nn.Dropout(0.5),
        )
        self.proj = nn.Sequential(nn.Conv2d(40, emb, 1), Rearrange("b e h w -> b (h w) e"))

    def forward(self, x):
        return self.proj(self.shallow(x))


class Conformer(nn.Module):
    def __init__(self, n_chans=3, n_times=1000, n_classes=2, emb=40, depth=6, heads=10):
        super().__init__()
        self.embed = PatchEmbedding(n_chans, emb)
        layer = nn.TransformerEncoderLayer(emb, heads, 4 * emb, dropout=0.5, batch_first=True,
                                           activation="gelu", norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, depth)
        with torch.no_grad():
            n_tok = self.embed(torch.zeros(1, 1, n_chans, n_times)).shape[1]
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(n_tok * emb, 256), nn.ELU(), nn.Dropout(0.5),
            nn.Linear(256, 32), nn.ELU(), nn.Dropout(0.3), nn.Linear(32, n_classes),
        )

    def forward(self, x):
        return self.head(self.transformer(self.embed(x.unsqueeze(1))))


def accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            c[0] += (model(x).argmax(1) == y).sum()
            c[1] += y.numel()
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/bci_iv_2b/mat")
    ap.add_argument("--subject", type=int, required=True)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--batch_size", type=int, default=72)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--eval_every", type=int, default=20)
    ap.add_argument("--out", default="ckpt/conformer_2b")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.subject)

    Xtr, ytr = load_sessions(args.root, args.subject, ["01T", "02T", "03T"])
    Xte, yte = load_sessions(args.root, args.subject, ["04E", "05E"])
    n_val = int(0.2 * 160)  # last 20 % of the 160 trials of session 03T
    Xval, yval = Xtr[-n_val:], ytr[-n_val:]
    Xtr, ytr = Xtr[:-n_val], ytr[:-n_val]
    mean, std = Xtr.mean(), Xtr.std()
    Xtr, Xval, Xte = (Xtr - mean) / std, (Xval - mean) / std, (Xte - mean) / std

    def dist_loader(X, y, bs, shuffle):
        ds = TensorDataset(torch.from_numpy(X), torch.from_numpy(y))
        sampler = DistributedSampler(ds, shuffle=shuffle, seed=args.subject)
        return DataLoader(ds, batch_size=bs, sampler=sampler, drop_last=shuffle), sampler

    train_dl, train_sampler = dist_loader(Xtr, ytr, args.batch_size, True)
    val_dl, _ = dist_loader(Xval, yval, 256, False)
    test_dl, _ = dist_loader(Xte, yte, 256, False)

    model = Conformer(n_chans=Xtr.shape[1], n_times=Xtr.shape[2]).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.999))
    ckpt_path = os.path.join(args.out, f"B{args.subject:02d}_best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    # different augmentation draws per rank, identical model init via DDP broadcast
    rng = np.random.default_rng(1000 * args.subject + rank)
    best_val = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_dl:
            xa, ya = segment_and_reconstruct(Xtr, ytr, n_aug_per_class=x.shape[0] // 2 // 2, rng=rng)
            x = torch.cat([x, torch.from_numpy(xa)]).to(device, non_blocking=True)
            y = torch.cat([y, torch.from_numpy(ya)]).to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        if (epoch + 1) % args.eval_every == 0:
            c = accuracy(model, val_dl, device)
            dist.all_reduce(c)
            val_acc = (c[0] / c[1]).item()
            if rank == 0:
                print(f"B{args.subject:02d} epoch {epoch + 1} loss {loss.item():.4f} val acc {val_acc:.4f}", flush=True)
                if val_acc > best_val:
                    best_val = val_acc
                    torch.save(model.state_dict(), ckpt_path)

    dist.barrier()
    # final test with the best checkpoint on a plain (non-DDP) copy of the network
    test_model = Conformer(n_chans=Xtr.shape[1], n_times=Xtr.shape[2]).to(device)
    test_model.load_state_dict(torch.load(ckpt_path, map_location=device))
    c = accuracy(test_model, test_dl, device)
    dist.all_reduce(c)
    if rank == 0:
        print(f"B{args.subject:02d} best val {best_val:.4f} test acc {(c[0] / c[1]).item():.4f}")
        with open(os.path.join(args.out, "results.txt"), "a") as f:
            f.write(f"B{args.subject:02d}\t{best_val:.4f}\t{(c[0] / c[1]).item():.4f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
