"""Multilingual printed-line recognizer (Latin + Cyrillic + Greek), CRNN with CTC.

Variable-width lines are bucketed by width so padding stays small.

    torchrun --nproc_per_node=4 09_crnn_ctc_multilingual.py --manifest data/lines/train.tsv \
        --val-manifest data/lines/val.tsv --init weights/crnn_latin.pt
"""
import argparse
import math
import os
import random
import time
import unicodedata

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
import torchvision.transforms.functional as TF


def read_manifest(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            img, width, text = line.rstrip("\n").split("\t", 2)
            rows.append((img, int(width), unicodedata.normalize("NFC", text)))
    return rows


class LineSet(Dataset):
    def __init__(self, rows, root, c2i, height=48, train=False):
        self.rows, self.root, self.c2i, self.h, self.train = rows, root, c2i, height, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        img = Image.open(os.path.join(self.root, path)).convert("L")
        w = max(8, round(img.width * self.h / img.height))
        img = img.resize((w, self.h), Image.BILINEAR)
        if self.train and random.random() < 0.5:
            img = TF.adjust_contrast(img, random.uniform(0.6, 1.4))
        x = TF.to_tensor(img)
        x = TF.normalize(x, [0.5], [0.5])
        y = torch.tensor([self.c2i[c] for c in text if c in self.c2i], dtype=torch.long)
        return x, y, text


def pad_collate(batch):
    xs, ys, texts = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    out = torch.full((len(xs), 1, xs[0].shape[1], W), -1.0)  # -1 == white after normalisation
    for i, x in enumerate(xs):
        out[i, :, :, : x.shape[-1]] = x
    widths = torch.tensor([x.shape[-1] for x in xs])
    return out, torch.cat(ys), torch.tensor([len(y) for y in ys]), widths, list(texts)


class DistributedBucketBatchSampler(Sampler):
    """Groups lines of similar width into batches; every rank gets the same number of batches."""

    def __init__(self, widths, batch_size, rank, world, seed=0, bucket_size=100):
        self.widths, self.bs, self.rank, self.world = widths, batch_size, rank, world
        self.seed, self.bucket = seed, bucket_size
        self.epoch = 0
        self.n_batches = math.ceil(len(widths) / batch_size / world)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = random.Random(self.seed + self.epoch)  # same permutation on every rank
        idx = list(range(len(self.widths)))
        g.shuffle(idx)
        chunks = [idx[i:i + self.bs * self.bucket] for i in range(0, len(idx), self.bs * self.bucket)]
        batches = []
        for ch in chunks:
            ch.sort(key=lambda k: self.widths[k])
            batches += [ch[i:i + self.bs] for i in range(0, len(ch), self.bs)]
        g.shuffle(batches)
        total = self.n_batches * self.world
        batches += batches[: total - len(batches)]  # pad by repeating, then stride
        return iter(batches[self.rank:total:self.world])

    def __len__(self):
        return self.n_batches


class CRNN(nn.Module):
    def __init__(self, n_classes, nh=256):
        super().__init__()
        chans = [1, 64, 128, 256, 256, 512, 512]
        pools = [(2, 2), (2, 2), None, (2, 1), None, (2, 1)]
        layers = []
        for cin, cout, pool in zip(chans[:-1], chans[1:], pools):
            layers += [nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]
            if pool:
                layers.append(nn.MaxPool2d(pool, pool))
        self.cnn = nn.Sequential(*layers)
        self.rnn = nn.LSTM(512, nh, num_layers=2, bidirectional=True, batch_first=True, dropout=0.2)
        self.out = nn.Linear(2 * nh, n_classes)

    def forward(self, x):
        f = self.cnn(x)
        f = F.adaptive_avg_pool2d(f, (1, f.shape[-1])).squeeze(2).transpose(1, 2)
        return self.out(self.rnn(f)[0])


def greedy(ids, i2c):
    out, prev = [], 0
    for k in ids:
        if k != prev and k != 0:
            out.append(i2c[k])
        prev = k
    return "".join(out)


@torch.no_grad()
def evaluate(model, loader, i2c, device):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)  # edits, ref chars, exact lines
    n = torch.zeros(1, device=device, dtype=torch.float64)
    for x, _, _, widths, texts in loader:
        best = model(x.to(device, non_blocking=True)).argmax(-1).cpu()
        for b, ref in enumerate(texts):
            hyp = greedy(best[b, : max(1, int(widths[b]) // 4)].tolist(), i2c)
            s[0] += editdistance.eval(hyp, ref)
            s[1] += len(ref)
            s[2] += float(hyp == ref)
        n += len(texts)
    dist.all_reduce(s)
    dist.all_reduce(n)
    model.train()
    return (s[0] / s[1]).item(), (s[2] / n).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--val-manifest", required=True)
    ap.add_argument("--root", default="data/lines")
    ap.add_argument("--init", default="", help="weights of an earlier (possibly DDP-saved) model")
    ap.add_argument("--out", default="runs/crnn_multi")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)

    train_rows = read_manifest(args.manifest)
    val_rows = read_manifest(args.val_manifest)

    # one process decides the alphabet, everyone uses exactly that list
    obj = [sorted({c for _, _, t in train_rows for c in t}) if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    alphabet = obj[0]
    c2i = {c: i + 1 for i, c in enumerate(alphabet)}
    i2c = {i: c for c, i in c2i.items()}

    train_set = LineSet(train_rows, args.root, c2i, train=True)
    batch_sampler = DistributedBucketBatchSampler([w for _, w, _ in train_rows], args.batch, rank, world, seed=7)
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, collate_fn=pad_collate,
                              num_workers=6, pin_memory=True)
    val_set = Subset(LineSet(val_rows, args.root, c2i), range(rank, len(val_rows), world))
    val_loader = DataLoader(val_set, batch_size=64, collate_fn=pad_collate, num_workers=4)

    model = CRNN(len(alphabet) + 1)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = sd.get("model", sd)
        sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
        # the output layer depends on the alphabet; keep only matching tensors
        own = model.state_dict()
        sd = {k: v for k, v in sd.items() if k in own and own[k].shape == v.shape}
        model.load_state_dict(sd, strict=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local])

    ctc = nn.CTCLoss(zero_infinity=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))

    best_cer = 1e9
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), 0.0
        for x, y, ylen, widths, _ in train_loader:
            x = x.to(device, non_blocking=True)
            logp = model(x).float().log_softmax(-1).transpose(0, 1)
            in_len = torch.clamp(widths // 4, min=1, max=logp.shape[0])
            loss = ctc(logp, y, in_len, ylen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            tot += loss.item()
        cer, line_acc = evaluate(model, val_loader, i2c, device)
        if rank == 0:
            print(f"epoch {epoch} loss {tot / len(train_loader):.4f} CER {cer:.4f} line-acc {line_acc:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            os.makedirs(args.out, exist_ok=True)
            ckpt = {"model": model.module.state_dict(), "alphabet": alphabet, "epoch": epoch}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if cer < best_cer:
                best_cer = cer
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
