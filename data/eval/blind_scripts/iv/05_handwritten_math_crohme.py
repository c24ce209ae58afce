"""Handwritten mathematical expression recognition on CROHME (DenseWAP-style).

The raw CROHME release is a folder of bitmaps plus a caption file. Decoding PNGs on the
fly was the bottleneck, so the images are binarised/resized once and kept in a pickle cache.

    torchrun --nnodes=1 --nproc_per_node=4 05_handwritten_math_crohme.py --root data/crohme
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/crohme")
    p.add_argument("--cache_dir", default="data/crohme/cache")
    p.add_argument("--out", default="exp/densewap")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1.0)   # Adadelta
    p.add_argument("--max_height", type=int, default=256)
    p.add_argument("--max_width", type=int, default=1024)
    p.add_argument("--eval_every", type=int, default=5)
    return p.parse_args()


def build_cache(root, split, max_h, max_w, cache_file):
    with open(os.path.join(root, f"{split}_caption.txt"), encoding="utf-8") as f:
        lines = [l.strip().split("\t") for l in f if l.strip()]
    samples = []
    for name, caption in tqdm(lines, desc=f"caching {split}"):
        img = Image.open(os.path.join(root, split, name + ".bmp")).convert("L")
        w, h = img.size
        scale = min(1.0, max_h / h, max_w / w)
        if scale < 1.0:
            img = img.resize((max(1, int(w * scale)), max(1, int(h * scale))), Image.BILINEAR)
        arr = (np.asarray(img) < 128).astype(np.uint8)        # ink = 1
        samples.append((name, arr, caption.split()))
    with open(cache_file, "wb") as f:
        pickle.dump(samples, f, protocol=pickle.HIGHEST_PROTOCOL)


def load_split(root, cache_dir, split, max_h, max_w):
    os.makedirs(cache_dir, exist_ok=True)
    cache_file = os.path.join(cache_dir, f"{split}_{max_h}x{max_w}.pkl")
    if not os.path.exists(cache_file):
        build_cache(root, split, max_h, max_w, cache_file)
    with open(cache_file, "rb") as f:
        return pickle.load(f)


class CROHME(Dataset):
    def __init__(self, samples, word2id):
        self.samples, self.w2i = samples, word2id

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        _, arr, caption = self.samples[i]
        x = torch.from_numpy(arr).float()[None]
        y = torch.tensor([self.w2i[w] for w in caption] + [self.w2i["<eol>"]])
        return x, y


def collate(batch):
    xs, ys = zip(*batch)
    H, W = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
    img = torch.zeros(len(xs), 1, H, W)
    mask = torch.zeros(len(xs), 1, H, W)
    for i, x in enumerate(xs):
        img[i, :, : x.shape[1], : x.shape[2]] = x
        mask[i, :, : x.shape[1], : x.shape[2]] = 1
    L = max(len(y) for y in ys)
    tgt = torch.zeros(len(ys), L, dtype=torch.long)
    tmask = torch.zeros(len(ys), L)
    for i, y in enumerate(ys):
        tgt[i, : len(y)] = y
        tmask[i, : len(y)] = 1
    return img, mask, tgt, tmask


class Bottleneck(nn.Module):
    def __init__(self, cin, growth):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(4 * growth), nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False)

    def forward(self, x):
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return torch.cat([x, out], 1)


class DenseNetB(nn.Module):
    def __init__(self, growth=24, depth=16, reduction=0.5):
        super().__init__()
        ch = 2 * growth
        self.conv0 = nn.Conv2d(1, ch, 7, 2, 3, bias=False)
        blocks = []
        for b in range(3):
            for _ in range(depth):
                blocks.append(Bottleneck(ch, growth))
                ch += growth
            if b < 2:
                out_ch = int(ch * reduction)
                blocks += [nn.BatchNorm2d(ch), nn.ReLU(True), nn.Conv2d(ch, out_ch, 1, bias=False),
                           nn.AvgPool2d(2, ceil_mode=True)]
                ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.out_ch = ch

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv0(x)), 2, ceil_mode=True)
        return self.blocks(x)     # stride 16


class WAP(nn.Module):
    def __init__(self, vocab, emb=256, hid=256, att=512):
        super().__init__()
        self.enc = DenseNetB()
        C = self.enc.out_ch
        self.embed = nn.Embedding(vocab, emb)
        self.init = nn.Linear(C, hid)
        self.gru1 = nn.GRUCell(emb, hid)
        self.gru2 = nn.GRUCell(C, hid)
        self.U_a = nn.Conv2d(C, att, 1)
        self.W_a = nn.Linear(hid, att)
        self.cov = nn.Conv2d(1, att, 11, padding=5)
        self.v = nn.Linear(att, 1)
        self.out_s, self.out_c, self.out_e = nn.Linear(hid, emb), nn.Linear(C, emb), nn.Linear(emb, emb)
        self.cls = nn.Linear(emb // 2, vocab)
        self.hid = hid

    def forward(self, img, mask, tgt):
        feat = self.enc(img)
        m = mask[:, :, ::16, ::16][:, :, : feat.shape[2], : feat.shape[3]]
        ctx_mean = (feat * m).sum((2, 3)) / m.sum((2, 3))
        s = torch.tanh(self.init(ctx_mean))
        Uf = self.U_a(feat)
        alpha_sum = torch.zeros_like(m)
        prev = torch.zeros(img.shape[0], dtype=torch.long, device=img.device)   # <sos> shares id 0 (<eol>)
        logits = []
        for t in range(tgt.shape[1]):
            e = self.embed(prev)
            s_hat = self.gru1(e, s)
            q = self.W_a(s_hat)[:, :, None, None] + Uf + self.cov(alpha_sum)
            score = self.v(torch.tanh(q).permute(0, 2, 3, 1)).squeeze(-1)
            score = score.masked_fill(m[:, 0] == 0, float("-inf"))
            alpha = score.flatten(1).softmax(-1).view_as(score)[:, None]
            alpha_sum = alpha_sum + alpha
            c = (alpha * feat).sum((2, 3))
            s = self.gru2(c, s_hat)
            o = self.out_s(s) + self.out_c(c) + self.out_e(e)
            o = o.view(o.shape[0], -1, 2).max(-1).values       # maxout
            logits.append(self.cls(F.dropout(o, 0.2, self.training)))
            prev = tgt[:, t]
        return torch.stack(logits, 1)


def exprate(model, loader, device):
    """Teacher-forced ExpRate proxy used during training (full beam search is run offline)."""
    model.eval()
    stats = torch.zeros(2, device=device)
    with torch.no_grad():
        for img, mask, tgt, tmask in loader:
            img, mask, tgt, tmask = (t.to(device) for t in (img, mask, tgt, tmask))
            pred = model(img, mask, tgt).argmax(-1)
            ok = ((pred == tgt) | (tmask == 0)).all(1)
            stats += torch.stack([ok.sum().float(), torch.tensor(float(len(ok)), device=device)])
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank = dist.get_rank()

    with open(os.path.join(args.root, "dictionary.txt"), encoding="utf-8") as f:
        words = [l.split()[0] for l in f if l.strip()]
    w2i = {w: i for i, w in enumerate(words)}    # dictionary.txt starts with <eol>=0
    train_samples = load_split(args.root, args.cache_dir, "train", args.max_height, args.max_width)
    test_samples = load_split(args.root, args.cache_dir, "14_test", args.max_height, args.max_width)

    train_ds, test_ds = CROHME(train_samples, w2i), CROHME(test_samples, w2i)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=args.batch_size, sampler=DistributedSampler(test_ds, shuffle=False),
                         collate_fn=collate, num_workers=2)

    model = WAP(len(words))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adadelta(model.parameters(), lr=args.lr, rho=0.95, eps=1e-6, weight_decay=1e-4)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0, tot = time.time(), 0.0
        for it, (img, mask, tgt, tmask) in enumerate(train_dl):
            img, mask, tgt, tmask = (t.to(device, non_blocking=True) for t in (img, mask, tgt, tmask))
            logits = model(img, mask, tgt)
            nll = F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none")
            loss = (nll * tmask).sum() / tmask.sum()
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            opt.step()
            tot += loss.item()
        if rank == 0:
            print(f"epoch {epoch} loss {tot / len(train_dl):.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            rate = exprate(model, test_dl, device)
            if rank == 0:
                print(f"  teacher-forced ExpRate {rate:.4f}", flush=True)
                if rate > best:
                    best = rate
                    torch.save({"model": model.module.state_dict(), "words": words, "epoch": epoch},
                               os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
