"""Building change detection on bi-temporal aerial pairs (LEVIR-CD+ / in-house 0.5 m pairs).

FC-Siam-diff style network: a shared encoder on both dates, absolute feature
differences fed to the decoder. Test scenes differ in size; each is evaluated whole with
an overlapping sliding window and no-data borders are excluded from the scores.

    torchrun --nproc_per_node=8 04_levircd_fcsiam.py --root /datasets/levircd_plus
"""
import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

Image.MAX_IMAGE_PIXELS = None
MEAN = np.array([0.406, 0.434, 0.393], dtype=np.float32)
STD = np.array([0.205, 0.192, 0.186], dtype=np.float32)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("checkpoints/fcsiam"))
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--overlap", type=int, default=64)
    return ap.parse_args()


def load_rgb(path):
    return (np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0 - MEAN) / STD


class CDPairs(Dataset):
    """Random crops from (A, B, label) triplets; label 255 marks no-data."""

    def __init__(self, root, crop, samples_per_image=16):
        self.names = sorted(p.name for p in (root / "train" / "A").glob("*.png"))
        self.root, self.crop, self.k = root / "train", crop, samples_per_image

    def __len__(self):
        return len(self.names) * self.k

    def __getitem__(self, i):
        name = self.names[i // self.k]
        a = load_rgb(self.root / "A" / name)
        b = load_rgb(self.root / "B" / name)
        y = np.asarray(Image.open(self.root / "label" / name), dtype=np.uint8)
        h, w = y.shape
        top, left = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        sl = (slice(top, top + self.crop), slice(left, left + self.crop))
        a, b, y = a[sl], b[sl], y[sl]
        if random.random() < 0.5:
            a, b, y = a[:, ::-1], b[:, ::-1], y[:, ::-1]
        if random.random() < 0.5:  # temporal swap: change is symmetric
            a, b = b, a
        y = np.where(y == 255, 255, (y > 0).astype(np.uint8))
        to_t = lambda z: torch.from_numpy(np.ascontiguousarray(z.transpose(2, 0, 1)))
        return to_t(a), to_t(b), torch.from_numpy(np.ascontiguousarray(y)).long()


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(True))


class FCSiamDiff(nn.Module):
    def __init__(self, chs=(32, 64, 128, 256)):
        super().__init__()
        self.enc = nn.ModuleList([block(3 if i == 0 else chs[i - 1], c) for i, c in enumerate(chs)])
        self.up = nn.ModuleList([nn.ConvTranspose2d(chs[i], chs[i - 1], 2, 2) for i in range(len(chs) - 1, 0, -1)])
        self.dec = nn.ModuleList([block(2 * chs[i - 1], chs[i - 1]) for i in range(len(chs) - 1, 0, -1)])
        self.head = nn.Conv2d(chs[0], 2, 1)

    def encode(self, x):
        feats = []
        for i, b in enumerate(self.enc):
            x = b(x if i == 0 else F.max_pool2d(x, 2))
            feats.append(x)
        return feats

    def forward(self, a, b):
        fa, fb = self.encode(a), self.encode(b)
        diffs = [torch.abs(x - y) for x, y in zip(fa, fb)]
        x = diffs[-1]
        for up, dec, skip in zip(self.up, self.dec, reversed(diffs[:-1])):
            x = dec(torch.cat([up(x), skip], 1))
        return self.head(x)


@torch.no_grad()
def predict_scene(net, a, b, crop, overlap):
    _, h, w = a.shape
    stride = crop - overlap
    acc = torch.zeros(2, h, w, device=a.device)
    cnt = torch.zeros(h, w, device=a.device)
    ys = sorted(set(list(range(0, h - crop, stride)) + [h - crop]))
    xs = sorted(set(list(range(0, w - crop, stride)) + [w - crop]))
    for y in ys:
        for x in xs:
            pa = a[None, :, y:y + crop, x:x + crop]
            pb = b[None, :, y:y + crop, x:x + crop]
            acc[:, y:y + crop, x:x + crop] += net(pa, pb)[0].softmax(0)
            cnt[y:y + crop, x:x + crop] += 1
    return (acc / cnt).argmax(0)


@torch.no_grad()
def evaluate(model, root, crop, overlap, device, rank, world):
    net = model.module
    net.eval()
    names = sorted(p.name for p in (root / "test" / "A").glob("*.png"))
    preds, gts = [], []
    for name in names[rank::world]:
        a = torch.from_numpy(load_rgb(root / "test" / "A" / name).transpose(2, 0, 1).copy()).to(device)
        b = torch.from_numpy(load_rgb(root / "test" / "B" / name).transpose(2, 0, 1).copy()).to(device)
        y = torch.from_numpy(np.asarray(Image.open(root / "test" / "label" / name), dtype=np.uint8).copy()).to(device)
        p = predict_scene(net, a, b, crop, overlap)
        valid = y != 255
        preds.append(p[valid].to(torch.uint8))
        gts.append((y[valid] > 0).to(torch.uint8))
    preds, gts = torch.cat(preds), torch.cat(gts)

    all_preds = [torch.empty_like(preds) for _ in range(world)]
    all_gts = [torch.empty_like(gts) for _ in range(world)]
    dist.all_gather(all_preds, preds)
    dist.all_gather(all_gts, gts)
    net.train()
    if rank != 0:
        return None
    p = torch.cat(all_preds).cpu().numpy()
    g = torch.cat(all_gts).cpu().numpy()
    return {"f1": f1_score(g, p), "precision": precision_score(g, p), "recall": recall_score(g, p)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100)

    ds = CDPairs(args.root, args.crop)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(FCSiamDiff()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    crit = nn.CrossEntropyLoss(weight=torch.tensor([0.2, 0.8], device=device), ignore_index=255)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        t0 = time.time()
        for a, b, y in dl:
            a, b, y = a.to(device, non_blocking=True), b.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(a, b), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.tensor(1.0, device=device)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {tot[0].item() / tot[1].item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            scores = evaluate(model, args.root, args.crop, args.overlap, device, rank, world)
            if rank == 0:
                print(f"  test F1 {scores['f1']:.4f} P {scores['precision']:.4f} R {scores['recall']:.4f}", flush=True)
                state = {"model": model.module.state_dict(), "epoch": epoch, "scores": scores}
                torch.save(state, args.out / "last.pth")
                if scores["f1"] > best_f1:
                    best_f1 = scores["f1"]
                    torch.save(state, args.out / "best.pth")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
