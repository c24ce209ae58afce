"""Patch SVDD: patch-level deep SVDD with self-supervised relative-position learning.

Hierarchical encoder (64x64 patches built from 32x32 sub-encoders), trained with
  * SVDD' loss: neighbouring patches should have close embeddings,
  * SSL loss: classify the relative position (8 neighbours) of two patches.
Anomaly map: distance of each test patch embedding to its nearest normal training embedding.

    torchrun --nproc_per_node=4 19_patch_svdd.py --obj bottle --lambda-svdd 1e-3
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
POS_TO_DIFF = {0: (-1, -1), 1: (-1, 0), 2: (-1, 1), 3: (0, -1), 4: (0, 1), 5: (1, -1), 6: (1, 0), 7: (1, 1)}


def load_images(root, obj, split, size=256):
    files = sorted((Path(root) / obj / split).glob("*/*.png"))
    imgs = np.stack([np.asarray(Image.open(f).convert("RGB").resize((size, size), Image.BILINEAR)) for f in files])
    return files, imgs


def normalize(imgs):
    x = imgs.astype(np.float32) / 255.0
    x = (x - x.mean(axis=(0, 1, 2))) / (x.std(axis=(0, 1, 2)) + 1e-6)
    return x.transpose(0, 3, 1, 2)


class PositionPairs(Dataset):
    """Random (patch, neighbour patch, relative position) triples, and (patch, jittered patch) pairs."""

    def __init__(self, x, K, repeat=100):
        self.x, self.K, self.repeat = x, K, repeat

    def __len__(self):
        return len(self.x) * self.repeat

    def __getitem__(self, idx):
        img = self.x[idx % len(self.x)]
        K, H = self.K, img.shape[-1]
        J = K // 4
        rng = np.random.default_rng()
        pos = int(rng.integers(8))
        dh, dw = POS_TO_DIFF[pos]
        h1 = int(rng.integers(K + J, H - 2 * K - J))
        w1 = int(rng.integers(K + J, H - 2 * K - J))
        h2 = h1 + dh * K + int(rng.integers(-J, J + 1))
        w2 = w1 + dw * K + int(rng.integers(-J, J + 1))
        p1, p2 = img[:, h1:h1 + K, w1:w1 + K], img[:, h2:h2 + K, w2:w2 + K]
        hj, wj = h1 + int(rng.integers(-J, J + 1)), w1 + int(rng.integers(-J, J + 1))
        p3 = img[:, hj:hj + K, wj:wj + K]
        return torch.from_numpy(p1.copy()), torch.from_numpy(p2.copy()), torch.from_numpy(p3.copy()), pos


class Enc32(nn.Module):
    def __init__(self, D=64):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 128, 5, 2), nn.LeakyReLU(0.1), nn.Conv2d(128, 128, 5, 2),
                                 nn.LeakyReLU(0.1), nn.Conv2d(128, 128, 5, 1), nn.LeakyReLU(0.1),
                                 nn.Conv2d(128, D, 1), nn.Tanh())

    def forward(self, x):
        return self.net(x)


class Enc64(nn.Module):
    def __init__(self, D=64):
        super().__init__()
        self.enc = Enc32(D)
        self.fuse = nn.Sequential(nn.Conv2d(D, 128, 2), nn.LeakyReLU(0.1), nn.Conv2d(128, D, 1), nn.Tanh())

    def forward(self, x):
        b = x.shape[0]
        subs = torch.cat([x[..., i:i + 32, j:j + 32] for i in (0, 32) for j in (0, 32)], 0)
        e = self.enc(subs).view(4, b, -1, 1, 1)
        grid = torch.cat([torch.cat([e[0], e[1]], -1), torch.cat([e[2], e[3]], -1)], -2)
        return self.fuse(grid)


class PatchSVDD(nn.Module):
    def __init__(self, D=64):
        super().__init__()
        self.enc64 = Enc64(D)
        self.cls64 = nn.Sequential(nn.Linear(D, 128), nn.LeakyReLU(0.1), nn.Linear(128, 128), nn.LeakyReLU(0.1),
                                   nn.Linear(128, 8))
        self.cls32 = nn.Sequential(nn.Linear(D, 128), nn.LeakyReLU(0.1), nn.Linear(128, 128), nn.LeakyReLU(0.1),
                                   nn.Linear(128, 8))

    def forward(self, p64a, p64b, p64j, p32a, p32b, p32j):
        e = lambda enc, x: enc(x).flatten(1)
        a64, b64, j64 = (e(self.enc64, t) for t in (p64a, p64b, p64j))
        a32, b32, j32 = (e(self.enc64.enc, t) for t in (p32a, p32b, p32j))
        logits64 = self.cls64(a64 - b64)
        logits32 = self.cls32(a32 - b32)
        svdd = (a64 - j64).norm(dim=1).mean() + (a32 - j32).norm(dim=1).mean()
        return logits64, logits32, svdd


@torch.no_grad()
def embed_dense(enc, x, K, stride, bs=64):
    """Embed all KxK patches with `stride`; returns (N, h, w, D)."""
    patches = F.unfold(x, K, stride=stride)  # N, 3*K*K, L
    n, _, L = patches.shape
    hw = int(L ** 0.5)
    patches = patches.transpose(1, 2).reshape(-1, 3, K, K)
    out = torch.cat([enc(patches[i:i + bs].to(DEVICE)).flatten(1).cpu() for i in range(0, len(patches), bs)])
    return out.view(n, hw, hw, -1)


@torch.no_grad()
def evaluate(model, x_train, x_test, labels, stride=16):
    model.eval()
    maps = []
    for enc, K in ((model.enc64, 64), (model.enc64.enc, 32)):
        tr = embed_dense(enc, torch.from_numpy(x_train), K, stride)
        te = embed_dense(enc, torch.from_numpy(x_test), K, stride)
        bank = tr.reshape(-1, tr.shape[-1]).to(DEVICE)
        q = te.reshape(-1, te.shape[-1]).to(DEVICE)
        d = torch.cat([torch.cdist(q[i:i + 4096], bank).min(1).values for i in range(0, len(q), 4096)])
        d = d.view(te.shape[0], 1, te.shape[1], te.shape[2])
        maps.append(F.interpolate(d, size=x_test.shape[-2:], mode="bilinear", align_corners=False).cpu())
    model.train()
    amap = maps[0] * maps[1]
    return roc_auc_score(labels, amap.flatten(1).max(1).values.numpy())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/mvtec_anomaly_detection")
    ap.add_argument("--obj", default="bottle")
    ap.add_argument("--lambda-svdd", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--save", default="ckpts/patch_svdd")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()

    _, train_imgs = load_images(args.data, args.obj, "train")
    test_files, test_imgs = load_images(args.data, args.obj, "test")
    x_train, x_test = normalize(train_imgs), normalize(test_imgs)
    labels = np.array([int(f.parent.name != "good") for f in test_files])

    ds64, ds32 = PositionPairs(x_train, 64), PositionPairs(x_train, 32)
    s64 = DistributedSampler(ds64, shuffle=True, drop_last=True)
    s32 = DistributedSampler(ds32, shuffle=True, drop_last=True)
    dl64 = DataLoader(ds64, batch_size=args.batch_size, sampler=s64, num_workers=4, drop_last=True, pin_memory=True)
    dl32 = DataLoader(ds32, batch_size=args.batch_size, sampler=s32, num_workers=4, drop_last=True, pin_memory=True)

    model = PatchSVDD().to(DEVICE)
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    save_dir = Path(args.save) / args.obj
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        s64.set_epoch(epoch)
        s32.set_epoch(epoch)
        t0 = time.time()
        for (a64, b64, j64, pos64), (a32, b32, j32, pos32) in zip(dl64, dl32):
            batch = [t.to(DEVICE, non_blocking=True) for t in (a64, b64, j64, a32, b32, j32)]
            pos64, pos32 = pos64.to(DEVICE), pos32.to(DEVICE)
            logits64, logits32, svdd = ddp(*batch)
            loss = F.cross_entropy(logits64, pos64) + F.cross_entropy(logits32, pos32) + args.lambda_svdd * svdd
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} ({time.time() - t0:.1f}s)", flush=True)

        if rank == 0 and (epoch + 1) % 20 == 0:
            auroc = evaluate(model, x_train, x_test, labels)
            print(f"[{args.obj}] epoch {epoch + 1} image AUROC {auroc:.4f}", flush=True)
            torch.save(model.state_dict(), save_dir / "enc_last.pt")
            if auroc > best:
                best = auroc
                torch.save(model.state_dict(), save_dir / "enc_best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
