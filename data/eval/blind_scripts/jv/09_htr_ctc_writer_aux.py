"""Handwritten line recognition (CNN-BLSTM-CTC) with an optional writer-classification head.

The writer head shares the CNN features and can be used as an auxiliary task
(--writer-loss-weight > 0) to make the features more writer-aware.

    torchrun --nproc_per_node=8 09_htr_ctc_writer_aux.py --data /data/rimes_lines --out runs/rimes_ctc
"""
import argparse
import json
import math
import os
import time

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with train.json / val.json / charset.json and images/")
    p.add_argument("--out", required=True)
    p.add_argument("--height", type=int, default=128)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 64")
    p.add_argument("--writer-loss-weight", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=2)
    return p.parse_args()


class RimesLines(Dataset):
    """json: list of {"image": ..., "text": ..., "writer": ...}"""

    def __init__(self, root, split, charset, writer_ids, height):
        with open(os.path.join(root, f"{split}.json"), encoding="utf-8") as f:
            self.items = json.load(f)
        self.root, self.height = root, height
        self.c2i = {c: i + 1 for i, c in enumerate(charset)}
        self.writer_ids = writer_ids

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = Image.open(os.path.join(self.root, "images", it["image"])).convert("L")
        w = max(self.height, round(img.width * self.height / img.height))
        img = img.resize((w, self.height), Image.LANCZOS)
        x = torch.from_numpy(255.0 - np.asarray(img, dtype=np.float32)).div_(255.0).unsqueeze(0)
        y = torch.tensor([self.c2i[c] for c in it["text"] if c in self.c2i], dtype=torch.long)
        wid = self.writer_ids.get(it["writer"], -100)
        return x, y, wid, it["text"]


def collate(batch):
    xs, ys, wids, texts = zip(*batch)
    W = int(math.ceil(max(x.shape[-1] for x in xs) / 8) * 8)
    imgs = torch.zeros(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        imgs[i, ..., : x.shape[-1]] = x
    widths = torch.tensor([x.shape[-1] for x in xs])
    return imgs, widths, torch.cat(ys), torch.tensor([len(y) for y in ys]), torch.tensor(wids), list(texts)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.n2(self.c2(F.relu(self.n1(self.c1(x))))) + self.skip(x))


class HTRNet(nn.Module):
    def __init__(self, n_chars, n_writers, height):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 32, 7, 2, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),   # /2
            ResBlock(32, 64, 2), ResBlock(64, 64, 1),                                          # /4
            ResBlock(64, 128, 2), ResBlock(128, 128, 1),                                       # /8
            ResBlock(128, 256, (2, 1)), ResBlock(256, 256, 1),
            nn.AdaptiveMaxPool2d((1, None)),
        )
        self.rnn = nn.LSTM(256, 256, num_layers=3, bidirectional=True, dropout=0.2, batch_first=True)
        self.ctc_head = nn.Linear(512, n_chars)
        self.writer_head = nn.Sequential(nn.Linear(256, 256), nn.ReLU(inplace=True), nn.Dropout(0.3),
                                         nn.Linear(256, n_writers))

    def forward(self, x, widths):
        f = self.cnn(x).squeeze(2).transpose(1, 2)          # B, T, 256
        T = f.shape[1]
        t_len = torch.div(widths, 8, rounding_mode="floor").clamp(1, T)
        mask = (torch.arange(T, device=x.device)[None] < t_len[:, None]).float().unsqueeze(-1)
        pooled = (f * mask).sum(1) / mask.sum(1)
        packed = nn.utils.rnn.pack_padded_sequence(f, t_len.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=T)
        return self.ctc_head(out), t_len, self.writer_head(pooled)


def decode(logits, t_len, charset):
    res = []
    for seq, n in zip(logits.argmax(-1).cpu().tolist(), t_len.tolist()):
        s, prev = [], 0
        for k in seq[:n]:
            if k and k != prev:
                s.append(charset[k - 1])
            prev = k
        res.append("".join(s))
    return res


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    with open(os.path.join(args.data, "charset.json"), encoding="utf-8") as f:
        charset = json.load(f)
    with open(os.path.join(args.data, "train.json"), encoding="utf-8") as f:
        writer_ids = {w: i for i, w in enumerate(sorted({it["writer"] for it in json.load(f)}))}

    train_ds = RimesLines(args.data, "train", charset, writer_ids, args.height)
    val_ds = RimesLines(args.data, "val", charset, writer_ids, args.height)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # strided shard of the validation lines, no padding duplicates
    val_part = Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_loader = DataLoader(val_part, batch_size=16, shuffle=False, collate_fn=collate, num_workers=args.workers)

    model = HTRNet(len(charset) + 1, len(writer_ids), args.height)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 64
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=6)
    ctc = nn.CTCLoss(zero_infinity=True)

    best = float("inf")
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (imgs, widths, tgt, tgt_len, wids, _) in enumerate(train_loader):
            imgs, widths = imgs.to(device, non_blocking=True), widths.to(device)
            logits, t_len, writer_logits = model(imgs, widths)
            log_probs = logits.log_softmax(-1).transpose(0, 1)
            loss = ctc(log_probs, tgt.to(device), t_len, tgt_len.to(device))
            if args.writer_loss_weight > 0:
                loss = loss + args.writer_loss_weight * F.cross_entropy(writer_logits, wids.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        if epoch % args.eval_every:
            continue
        model.eval()
        stats = torch.zeros(4, device=device, dtype=torch.float64)  # char err, chars, word err, words
        with torch.no_grad():
            for imgs, widths, _, _, _, texts in val_loader:
                logits, t_len, _ = model.module(imgs.to(device), widths.to(device))
                for p, g in zip(decode(logits, t_len, charset), texts):
                    stats += torch.tensor([editdistance.eval(p, g), len(g),
                                           editdistance.eval(p.split(), g.split()), len(g.split())],
                                          device=device, dtype=torch.float64)
        dist.all_reduce(stats)
        cer, wer = (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item()
        sched.step(cer)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): CER {cer:.4f} WER {wer:.4f}", flush=True)
            ck = {"model": model.module.state_dict(), "charset": charset, "writers": writer_ids, "epoch": epoch}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if cer < best:
                best = cer
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
