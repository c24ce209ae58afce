"""Text detection pre-training on pages synthesised on the fly (no dataset on disk).

Pages are rendered with PIL: random fonts, sizes, colours and word layouts on noisy backgrounds.
A lightweight DB (differentiable binarisation) detector is trained on them.

Single node, one process per GPU, started with mp.spawn:
    python 13_dbnet_synth_spawn.py --fonts /usr/share/fonts/truetype --gpus 4
"""
import argparse
import glob
import math
import os
import random
import time

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

WORDS = ("invoice total amount date number account customer address phone email order qty price tax "
         "subtotal payment due balance description item reference vat net gross bank iban swift").split()


def render_page(rng, fonts, size):
    bg = rng.randint(200, 255)
    img = Image.new("RGB", (size, size), (bg, bg, bg))
    draw = ImageDraw.Draw(img)
    boxes = []
    y = rng.randint(5, 40)
    while y < size - 20:
        font = ImageFont.truetype(rng.choice(fonts), rng.randint(12, 42))
        x = rng.randint(5, 60)
        line_h = 0
        while x < size - 40:
            word = rng.choice(WORDS)
            if rng.random() < 0.3:
                word = word.upper()
            if rng.random() < 0.2:
                word = str(rng.randint(0, 99999))
            l, t, r, b = draw.textbbox((x, y), word, font=font)
            if r >= size - 2 or b >= size - 2:
                break
            ink = tuple(rng.randint(0, 90) for _ in range(3))
            draw.text((x, y), word, font=font, fill=ink)
            boxes.append((l, t, r, b))
            line_h = max(line_h, b - y)
            x = r + rng.randint(8, 40)
        y += line_h + rng.randint(4, 40)
    arr = np.asarray(img).astype(np.float32)
    arr += np.random.default_rng(rng.randint(0, 2 ** 31)).normal(0, rng.uniform(0, 10), arr.shape)
    return np.clip(arr, 0, 255).astype(np.uint8), boxes


def db_targets(boxes, size, r=0.4):
    prob = np.zeros((size, size), np.float32)
    thr = np.zeros((size, size), np.float32)
    thr_mask = np.zeros((size, size), np.float32)
    for l, t, rr, b in boxes:
        w, h = rr - l, b - t
        d = (w * h) * (1 - r * r) / max(2 * (w + h), 1)
        sl, st, sr, sb = int(l + d), int(t + d), int(rr - d), int(b - d)
        if sr > sl and sb > st:
            prob[st:sb, sl:sr] = 1.0
        cv2.rectangle(thr, (int(l), int(t)), (int(rr), int(b)), 0.7, 2)
        thr_mask[max(0, int(t - d)):int(b + d), max(0, int(l - d)):int(rr + d)] = 1.0
    return prob, thr + 0.3, thr_mask


def to_tensor(img):
    x = torch.from_numpy(img).permute(2, 0, 1).float() / 255.0
    return (x - 0.5) / 0.25


class SynthPages(IterableDataset):
    """Endless stream; each (rank, worker, epoch) draws from its own RNG so no two streams repeat."""

    def __init__(self, fonts, size, rank, seed=0):
        self.fonts, self.size, self.rank, self.seed = fonts, size, rank, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        wi = get_worker_info()
        wid = wi.id if wi is not None else 0
        rng = random.Random(hash((self.seed, self.rank, wid, self.epoch)))
        while True:
            img, boxes = render_page(rng, self.fonts, self.size)
            prob, thr, thr_mask = db_targets(boxes, self.size)
            yield to_tensor(img), torch.from_numpy(prob), torch.from_numpy(thr), torch.from_numpy(thr_mask)


class FixedSynthPages(Dataset):
    """Deterministic validation pages: page i is always rendered from seed i."""

    def __init__(self, fonts, size, n):
        self.fonts, self.size, self.n = fonts, size, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img, boxes = render_page(random.Random(10_000_000 + i), self.fonts, self.size)
        prob, _, _ = db_targets(boxes, self.size)
        return to_tensor(img), torch.from_numpy(prob)


class DBLite(nn.Module):
    def __init__(self, backbone="resnet34", k=50):
        super().__init__()
        self.body = timm.create_model(backbone, pretrained=True, features_only=True, out_indices=(1, 2, 3, 4))
        chs = self.body.feature_info.channels()
        self.lat = nn.ModuleList([nn.Conv2d(c, 128, 1) for c in chs])
        self.fuse = nn.Sequential(nn.Conv2d(512, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.prob = nn.Sequential(nn.ConvTranspose2d(128, 64, 2, 2), nn.BatchNorm2d(64), nn.ReLU(True),
                                  nn.ConvTranspose2d(64, 1, 2, 2))
        self.thr = nn.Sequential(nn.ConvTranspose2d(128, 64, 2, 2), nn.BatchNorm2d(64), nn.ReLU(True),
                                 nn.ConvTranspose2d(64, 1, 2, 2))
        self.k = k

    def forward(self, x):
        feats = [l(f) for l, f in zip(self.lat, self.body(x))]
        size = feats[0].shape[-2:]
        fused = self.fuse(torch.cat([F.interpolate(f, size=size, mode="bilinear", align_corners=False)
                                     for f in feats], 1))
        p = self.prob(fused).squeeze(1)  # logits
        t = torch.sigmoid(self.thr(fused).squeeze(1))
        b = torch.sigmoid(self.k * (torch.sigmoid(p) - t))
        return p, t, b


def loss_fn(out, prob, thr, thr_mask):
    p_logit, t, b = out
    l_prob = F.binary_cross_entropy_with_logits(p_logit, prob)
    l_thr = (torch.abs(t - thr) * thr_mask).sum() / (thr_mask.sum() + 1e-6)
    inter = (b * prob).sum()
    l_bin = 1 - 2 * inter / (b.sum() + prob.sum() + 1e-6)
    return l_prob + 10 * l_thr + l_bin


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, prob in loader:
        x, prob = x.to(device), prob.to(device)
        pred = (torch.sigmoid(model(x)[0]) > 0.3).float()
        s += torch.stack([(pred * prob).sum(), pred.sum(), prob.sum()])
    dist.all_reduce(s)
    model.train()
    p, r = (s[0] / s[1].clamp(min=1)).item(), (s[0] / s[2].clamp(min=1)).item()
    return 2 * p * r / max(p + r, 1e-9)


def worker(local_rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)

    fonts = sorted(glob.glob(os.path.join(args.fonts, "**", "*.ttf"), recursive=True))
    train_ds = SynthPages(fonts, args.size, local_rank, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch, num_workers=args.workers, pin_memory=True)
    val_ds = FixedSynthPages(fonts, args.size, args.val_pages)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(local_rank, len(val_ds), world_size)),
                        batch_size=args.batch, num_workers=2)

    model = DBLite(args.backbone)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * args.steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.03)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_ds.set_epoch(epoch)
        it = iter(train_dl)
        t0 = time.time()
        for step in range(args.steps_per_epoch):  # identical step count on every rank
            x, prob, thr, thr_mask = [t.to(device, non_blocking=True) for t in next(it)]
            loss = loss_fn(model(x), prob, thr, thr_mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if local_rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        del it  # shut down this epoch's workers so the next epoch re-seeds them
        f1 = validate(model, val_dl, device)
        if local_rank == 0:
            print(f"epoch {epoch} val pixel-F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fonts", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--out", default="runs/db_synth")
    ap.add_argument("--backbone", default="resnet34")
    ap.add_argument("--size", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--steps-per-epoch", type=int, default=2000)
    ap.add_argument("--val-pages", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", default="29533")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
