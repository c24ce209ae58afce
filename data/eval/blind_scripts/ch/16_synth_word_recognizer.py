"""Train a lightweight word recognizer purely on synthetic word images generated on the fly.

Rendering happens in the DataLoader workers; the heavier distortions (elastic warp, blur, noise)
are done with torch ops on the rank's GPU.

    torchrun --nproc_per_node=4 16_synth_word_recognizer.py --fonts fonts/ --lexicon lexicon/en_90k.txt \
        --val-dir data/real_words/val
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!\"#$%&'()*+,-./:;<=>?@[]_"
C2I = {c: i + 1 for i, c in enumerate(CHARS)}
H, W = 32, 128


def elastic_warp(x, alpha=2.0, sigma=4.0):
    """x: (C, H, W) on GPU. Smooth random displacement field + grid_sample."""
    c, h, w = x.shape
    disp = torch.randn(1, 2, h // 4, w // 4, device=x.device) * alpha / max(h, w)
    disp = F.interpolate(disp, size=(h, w), mode="bicubic", align_corners=False)
    k = int(sigma) * 2 + 1
    disp = F.avg_pool2d(disp, k, stride=1, padding=k // 2)
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, h, device=x.device), torch.linspace(-1, 1, w, device=x.device),
                            indexing="ij")
    grid = torch.stack([xs, ys], -1).unsqueeze(0) + disp.permute(0, 2, 3, 1) * 8
    return F.grid_sample(x.unsqueeze(0), grid, mode="bilinear", padding_mode="border", align_corners=False)[0]


class SynthWordDataset(Dataset):
    """Virtual dataset of `length` samples; sample i is drawn from a per-call RNG, so epochs differ."""

    def __init__(self, lexicon, fonts, length, device):
        self.lexicon, self.fonts, self.length = lexicon, fonts, length
        self.device = device

    def __len__(self):
        return self.length

    def render(self, word, rng):
        font = ImageFont.truetype(rng.choice(self.fonts), rng.randint(24, 48))
        l, t, r, b = font.getbbox(word)
        pad = rng.randint(2, 10)
        bg, fg = rng.randint(140, 255), rng.randint(0, 110)
        img = Image.new("L", (r - l + 2 * pad, b - t + 2 * pad), bg)
        ImageDraw.Draw(img).text((pad - l, pad - t), word, font=font, fill=fg)
        if rng.random() < 0.5:
            img = img.rotate(rng.uniform(-4, 4), resample=Image.BILINEAR, expand=True, fillcolor=bg)
        return img.resize((W, H), Image.BILINEAR)

    def __getitem__(self, idx):
        rng = random.Random()
        word = rng.choice(self.lexicon)
        if rng.random() < 0.2:
            word = word.upper()
        elif rng.random() < 0.2:
            word = word.capitalize()
        img = np.asarray(self.render(word, rng), dtype=np.float32) / 255.0
        x = torch.from_numpy(img).unsqueeze(0).to(self.device)
        if rng.random() < 0.7:
            x = elastic_warp(x)
        if rng.random() < 0.3:
            x = F.avg_pool2d(x.unsqueeze(0), 3, 1, 1)[0]
        x = (x + torch.randn_like(x) * rng.uniform(0, 0.05)).clamp(0, 1)
        x = (x - 0.5) / 0.5
        return x.cpu(), word


class RealWords(Dataset):
    def __init__(self, root):
        with open(os.path.join(root, "gt.txt"), encoding="utf-8") as f:
            self.items = [l.rstrip("\n").split(" ", 1) for l in f]
        self.root = root

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        fn, word = self.items[i]
        img = Image.open(os.path.join(self.root, fn)).convert("L").resize((W, H), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).unsqueeze(0)
        return (x - 0.5) / 0.5, word


def collate(batch):
    xs, words = zip(*batch)
    targets = [torch.tensor([C2I[c] for c in w if c in C2I]) for w in words]
    return torch.stack(xs), torch.cat(targets), torch.tensor([len(t) for t in targets]), list(words)


class MobileRec(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = timm.create_model("mobilenetv3_large_100", pretrained=True, in_chans=1,
                                          features_only=True, out_indices=(2,))
        ch = self.backbone.feature_info.channels()[-1]
        self.proj = nn.Conv2d(ch, 256, 1)
        self.rnn = nn.LSTM(256, 128, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(256, len(CHARS) + 1)

    def forward(self, x):
        x = F.interpolate(x, size=(H * 2, W * 2), mode="bilinear", align_corners=False)
        f = self.proj(self.backbone(x)[0]).mean(2).transpose(1, 2)  # B, T, 256
        return self.fc(self.rnn(f)[0])


def greedy(logits):
    out = []
    for row in logits.argmax(-1).cpu().tolist():
        s, prev = [], 0
        for k in row:
            if k and k != prev:
                s.append(CHARS[k - 1])
            prev = k
        out.append("".join(s))
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, _, _, words in loader:
        preds = greedy(model(x.to(device, non_blocking=True)))
        t[0] += sum(p.lower() == w.lower() for p, w in zip(preds, words))
        t[1] += len(words)
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fonts", required=True)
    ap.add_argument("--lexicon", required=True)
    ap.add_argument("--val-dir", required=True)
    ap.add_argument("--out", default="runs/synth_words")
    ap.add_argument("--samples-per-epoch", type=int, default=2_000_000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    with open(args.lexicon, encoding="utf-8") as f:
        lexicon = [w.strip() for w in f if w.strip() and len(w.strip()) <= 24]
    fonts = sorted(glob.glob(os.path.join(args.fonts, "*.ttf")) + glob.glob(os.path.join(args.fonts, "*.otf")))

    model = MobileRec().to(device)
    model = DDP(model, device_ids=[local_rank])

    # each rank draws its own share of the virtual epoch
    train_ds = SynthWordDataset(lexicon, fonts, args.samples_per_epoch // world, device)
    train_dl = DataLoader(train_ds, batch_size=args.batch, shuffle=False, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_ds = RealWords(args.val_dir)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=512, collate_fn=collate,
                        num_workers=4)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.02)
    ctc = nn.CTCLoss(zero_infinity=True)

    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        for it, (x, y, ylen, _) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            logp = model(x).float().log_softmax(-1).transpose(0, 1)
            loss = ctc(logp, y, torch.full((x.shape[0],), logp.shape[0], dtype=torch.long), ylen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (it + 1):.3f}s/it", flush=True)
        acc = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: real-word accuracy {acc:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "chars": CHARS}, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "chars": CHARS}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
