"""Gated-CNN + BiGRU CTC recognizer (Flor et al. style) for the Bentham line dataset.

Line images are binarised (Sauvola), deslanted and height-normalised once and stored in an
HDF5 cache next to the data; later runs read the cache directly.

    torchrun --nproc_per_node=4 14_bentham_gated_cnn_h5cache.py --bentham /data/BenthamDatasetR0-GT --out runs/bentham
"""
import argparse
import os
import time

import cv2
import editdistance
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from skimage.filters import threshold_sauvola
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

HEIGHT = 64


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--bentham", required=True)
    p.add_argument("--cache-dir", default=None, help="defaults to <bentham>/cache")
    p.add_argument("--out", default="runs/bentham")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="reference lr for 4 GPUs")
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def deslant(img, alpha_range=np.arange(-1.0, 1.01, 0.1)):
    """pick the shear that maximises the vertical projection energy"""
    best, best_alpha = -1, 0.0
    h, w = img.shape
    for a in alpha_range:
        M = np.float32([[1, a, -a * h / 2], [0, 1, 0]])
        sheared = cv2.warpAffine(img, M, (w, h), flags=cv2.INTER_NEAREST, borderValue=0)
        proj = sheared.sum(0)
        score = (proj ** 2).sum()
        if score > best:
            best, best_alpha = score, a
    M = np.float32([[1, best_alpha, -best_alpha * h / 2], [0, 1, 0]])
    return cv2.warpAffine(img, M, (w, h), flags=cv2.INTER_LINEAR, borderValue=0)


def preprocess_line(path):
    g = cv2.imread(path, cv2.IMREAD_GRAYSCALE)
    ink = (g < threshold_sauvola(g, window_size=25)).astype(np.uint8) * 255
    ink = deslant(ink)
    ys, xs = np.nonzero(ink)
    if len(xs):
        ink = ink[max(0, ys.min() - 2): ys.max() + 3, max(0, xs.min() - 2): xs.max() + 3]
    w = max(HEIGHT // 2, int(ink.shape[1] * HEIGHT / max(1, ink.shape[0])))
    return cv2.resize(ink, (w, HEIGHT), interpolation=cv2.INTER_AREA)


def split_ids(root, name):
    with open(os.path.join(root, "Partitions", f"{name}.lst")) as f:
        return [l.strip() for l in f if l.strip()]


def build_cache(root, split, path):
    ids = split_ids(root, split)
    str_dt = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as h5:
        imgs = h5.create_dataset("images", (len(ids),), dtype=h5py.vlen_dtype(np.uint8))
        widths = h5.create_dataset("widths", (len(ids),), dtype=np.int32)
        texts = h5.create_dataset("texts", (len(ids),), dtype=str_dt)
        for i, lid in enumerate(ids):
            line = preprocess_line(os.path.join(root, "Images", "Lines", lid + ".png"))
            with open(os.path.join(root, "Transcriptions", lid + ".txt"), encoding="utf-8") as f:
                text = " ".join(f.read().split())
            imgs[i] = line.reshape(-1)
            widths[i] = line.shape[1]
            texts[i] = text


class H5Lines(Dataset):
    def __init__(self, path, vocab=None):
        self.path = path
        with h5py.File(path, "r") as h5:
            self.widths = h5["widths"][:]
            self.texts = [t.decode("utf-8") if isinstance(t, bytes) else t for t in h5["texts"][:]]
        self.vocab = vocab or sorted(set("".join(self.texts)))
        self.stoi = {c: i + 1 for i, c in enumerate(self.vocab)}
        self.h5 = None

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        if self.h5 is None:  # open lazily inside each worker
            self.h5 = h5py.File(self.path, "r")
        img = self.h5["images"][i].reshape(HEIGHT, self.widths[i]).astype(np.float32) / 255.0
        y = [self.stoi[c] for c in self.texts[i] if c in self.stoi]
        return torch.from_numpy(img)[None], torch.tensor(y, dtype=torch.long), self.texts[i]


def collate(batch):
    xs, ys, ts = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    W += (-W) % 4
    out = torch.zeros(len(xs), 1, HEIGHT, W)
    for i, x in enumerate(xs):
        out[i, ..., : x.shape[-1]] = x
    return out, torch.tensor([x.shape[-1] for x in xs]), torch.cat(ys), torch.tensor([len(y) for y in ys]), ts


class GatedConv(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, 2 * c, 3, padding=1)

    def forward(self, x):
        a, b = self.conv(x).chunk(2, dim=1)
        return x * torch.sigmoid(a) * torch.tanh(b) + x


class FlorNet(nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.PReLU(16), nn.InstanceNorm2d(16, affine=True), nn.MaxPool2d(2),
            GatedConv(16),
            nn.Conv2d(16, 32, 3, padding=1), nn.PReLU(32), nn.InstanceNorm2d(32, affine=True), nn.MaxPool2d(2),
            GatedConv(32),
            nn.Conv2d(32, 64, 3, padding=1), nn.PReLU(64), nn.InstanceNorm2d(64, affine=True), nn.MaxPool2d((2, 1)),
            GatedConv(64), nn.Dropout2d(0.2),
            nn.Conv2d(64, 128, 3, padding=1), nn.PReLU(128), nn.InstanceNorm2d(128, affine=True),
            nn.MaxPool2d((2, 1)), GatedConv(128), nn.Dropout2d(0.2),
        )
        self.gru = nn.GRU(128 * (HEIGHT // 16), 192, num_layers=2, bidirectional=True, dropout=0.3)
        self.out = nn.Linear(384, n_out)

    def forward(self, x):
        f = self.features(x)
        b, c, h, w = f.shape
        f, _ = self.gru(f.permute(3, 0, 1, 2).reshape(w, b, c * h))
        return self.out(f)


def decode(lp, lens, vocab):
    res = []
    for b, seq in enumerate(lp.argmax(-1).t().tolist()):
        s, prev = [], 0
        for k in seq[: lens[b]]:
            if k and k != prev:
                s.append(vocab[k - 1])
            prev = k
        res.append("".join(s))
    return res


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    cache_dir = args.cache_dir or os.path.join(args.bentham, "cache")
    os.makedirs(cache_dir, exist_ok=True)
    caches = {}
    for split in ("TrainLines", "ValidationLines"):
        path = os.path.join(cache_dir, f"{split}_h{HEIGHT}.h5")
        if not os.path.exists(path):
            print(f"[rank {rank}] building {path}", flush=True)
            build_cache(args.bentham, split, path)
        caches[split] = path

    train_ds = H5Lines(caches["TrainLines"])
    vocab = train_ds.vocab
    val_full = H5Lines(caches["ValidationLines"], vocab=vocab)
    val_ds = Subset(val_full, range(rank, len(val_full), world))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=32, num_workers=args.workers, collate_fn=collate)

    model = DDP(FlorNet(len(vocab) + 1).to(device), device_ids=[local_rank])
    opt = torch.optim.RMSprop(model.parameters(), lr=args.lr * world / 4)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.2, patience=15)
    ctc = nn.CTCLoss(zero_infinity=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for x, widths, y, ylen, _ in train_loader:
            lp = model(x.to(device, non_blocking=True)).log_softmax(-1)
            xlen = (widths // 4).clamp(max=lp.shape[0]).to(device)
            loss = ctc(lp, y.to(device), xlen, ylen.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        ev = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, widths, _, _, texts in val_loader:
                lp = model.module(x.to(device)).log_softmax(-1)
                for p, g in zip(decode(lp, (widths // 4).tolist(), vocab), texts):
                    ev[0] += editdistance.eval(p, g)
                    ev[1] += len(g)
        dist.all_reduce(tr)
        dist.all_reduce(ev)
        cer = (ev[0] / ev[1]).item()
        sched.step(cer)
        if rank == 0:
            print(f"epoch {epoch:3d} {time.time() - t0:5.0f}s loss {(tr[0] / tr[1]).item():.4f} CER {cer:.4f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            ck = {"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch, "cer": cer}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if cer < best:
                best = cer
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
