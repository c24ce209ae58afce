"""
Line-level HTR with a CNN + Transformer encoder and CTC head, plus an auxiliary writer-identification
head that is trained only on batches coming from the writer-annotated subset (CVL / IAM forms).

Single node, one process per GPU started with torch.multiprocessing:
    python 15_htr_transformer_spawn_writerid.py --data /data/htr_lines --out runs/htr_tf_wid
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--max-width", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--wid-weight", type=float, default=0.2)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class HTRLines(Dataset):
    """index.json: [{"img": "...", "text": "...", "writer": int or null}, ...]"""

    def __init__(self, root, split, vocab, height, max_width, train):
        with open(os.path.join(root, f"{split}.json"), encoding="utf-8") as f:
            self.items = json.load(f)
        self.root, self.h, self.maxw, self.train = root, height, max_width, train
        self.c2i = {c: i + 1 for i, c in enumerate(vocab)}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        im = Image.open(os.path.join(self.root, it["img"])).convert("L")
        w = min(self.maxw, max(32, round(im.width * self.h / im.height)))
        if self.train:
            w = min(self.maxw, int(w * random.uniform(0.8, 1.2)))
        im = im.resize((w, self.h), Image.BILINEAR)
        x = torch.from_numpy(1.0 - np.asarray(im, np.float32) / 255.0)[None]
        y = torch.tensor([self.c2i[c] for c in it["text"] if c in self.c2i], dtype=torch.long)
        wid = -1 if it.get("writer") is None else int(it["writer"])
        return x, y, it["text"], wid


def collate(batch):
    xs, ys, ts, ws = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    img = torch.zeros(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        img[i, :, :, : x.shape[-1]] = x
    return img, torch.cat(ys), torch.tensor([len(y) for y in ys]), list(ts), torch.tensor(ws)


class HTRTransformer(nn.Module):
    def __init__(self, n_cls, n_writers, height, d=256, layers=6):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, 1, 1), nn.BatchNorm2d(128), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, 1, 1), nn.BatchNorm2d(256), nn.GELU(), nn.MaxPool2d((2, 1)),
            nn.Conv2d(256, d, 3, 1, 1), nn.BatchNorm2d(d), nn.GELU(), nn.MaxPool2d((2, 1)),
        )
        self.proj = nn.Linear(d * (height // 16), d)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
                                     for _ in range(layers)])
        self.ctc_head = nn.Linear(d, n_cls)
        self.wid_head = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, n_writers))

    def forward(self, x, with_writer=False):
        f = self.cnn(x)
        b, c, h, w = f.shape
        f = self.proj(f.permute(0, 3, 1, 2).reshape(b, w, c * h))
        for layer in self.layers:
            f = checkpoint(layer, f, use_reentrant=False) if self.training else layer(f)
        logits = self.ctc_head(f)
        if with_writer:
            return logits, self.wid_head(f.mean(1))
        return logits


def decode(logits, vocab):
    out = []
    for seq in logits.argmax(-1).tolist():
        s, prev = [], 0
        for k in seq:
            if k and k != prev:
                s.append(vocab[k - 1])
            prev = k
        out.append("".join(s))
    return out


def char_errors(p, t):
    d = list(range(len(t) + 1))
    for i, a in enumerate(p, 1):
        prev, d[0] = d[0], i
        for j, b in enumerate(t, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (a != b))
    return d[-1]


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(rank)
    torch.manual_seed(0)

    with open(os.path.join(args.data, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)  # {"vocab": [...], "n_writers": int}
    vocab = meta["vocab"]
    train_ds = HTRLines(args.data, "train", vocab, args.height, args.max_width, True)
    val_ds = HTRLines(args.data, "val", vocab, args.height, args.max_width, False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=6, collate_fn=collate,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size)), 32,
                        num_workers=2, collate_fn=collate)

    model = HTRTransformer(len(vocab) + 1, meta["n_writers"], args.height)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict({k.removeprefix("module."): v for k, v in ck["model"].items()})
        start_epoch = ck["epoch"] + 1
    model = model.to(device)
    # wid_head only sees batches that contain writer labels, which differ per rank and step
    model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if args.resume:
        opt.load_state_dict(ck["opt"])
    ctc = nn.CTCLoss(zero_infinity=True)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y, ylen, _, wid in train_dl:
            x, wid = x.to(device, non_blocking=True), wid.to(device)
            has_wid = bool((wid >= 0).any())
            if has_wid:
                logits, wid_logits = model(x, with_writer=True)
            else:
                logits = model(x)
            lp = logits.log_softmax(-1).transpose(0, 1)
            loss = ctc(lp, y, torch.full((x.size(0),), lp.size(0), dtype=torch.long), ylen)
            if has_wid:
                loss = loss + args.wid_weight * F.cross_entropy(wid_logits, wid, ignore_index=-1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()

        # validation: each rank decodes its own slice, error counts are summed
        model.module.eval()
        errs = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, _, _, texts, _ in val_dl:
                for p, t in zip(decode(model.module(x.to(device)), vocab), texts):
                    errs[0] += char_errors(p, t)
                    errs[1] += len(t)
        dist.all_reduce(errs)
        if rank == 0:
            print(f"epoch {epoch} val CER {(errs[0] / errs[1]).item():.4f}", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    n_gpus = torch.cuda.device_count()
    mp.spawn(worker, args=(n_gpus, args), nprocs=n_gpus, join=True)
