#!/usr/bin/env python3
# Word-level HTR on RIMES (French), Puigcerver-style CNN + BLSTM with CTC.
#
#   torchrun --nproc_per_node=4 09_htr_rimes_words.py --data /data/RIMES/words --epochs 200
#
import argparse
import json
import os
import unicodedata

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageOps
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

try:
    import Levenshtein
except ImportError:  # fall back to the pure-python one
    import editdistance as Levenshtein
    Levenshtein.distance = Levenshtein.eval


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with train.json / valid.json / test.json + images/")
    p.add_argument("--charset", default="", help="optional charset json; built from train.json otherwise")
    p.add_argument("--height", type=int, default=128)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--patience", type=int, default=20)
    p.add_argument("--save-dir", default="exp/htr_rimes")
    return p.parse_args()


def normalize(t):
    return unicodedata.normalize("NFC", t)


class RimesWords(Dataset):
    def __init__(self, root, split, charset, height, width, augment=False):
        with open(os.path.join(root, f"{split}.json"), encoding="utf-8") as f:
            self.items = json.load(f)  # list of {"image": ..., "text": ...}
        self.root, self.h, self.w, self.augment = root, height, width, augment
        self.c2i = {c: i + 1 for i, c in enumerate(charset)}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        it = self.items[idx]
        img = Image.open(os.path.join(self.root, "images", it["image"])).convert("L")
        img = ImageOps.invert(img)
        if self.augment:
            img = img.rotate(np.random.uniform(-3, 3), resample=Image.BILINEAR, expand=True)
            sx = np.random.uniform(0.8, 1.2)
            img = img.resize((max(1, int(img.width * sx)), img.height))
        scale = min(self.h / img.height, self.w / img.width)
        img = img.resize((max(1, int(img.width * scale)), max(1, int(img.height * scale))), Image.BILINEAR)
        canvas = Image.new("L", (self.w, self.h), 0)
        canvas.paste(img, (0, (self.h - img.height) // 2))
        x = torch.from_numpy(np.asarray(canvas, np.float32) / 255.0)[None]
        text = normalize(it["text"])
        y = torch.tensor([self.c2i[c] for c in text if c in self.c2i], dtype=torch.long)
        return x, y, text


def collate(batch):
    x, y, t = zip(*batch)
    return torch.stack(x), torch.cat(y), torch.tensor([len(v) for v in y]), list(t)


class Puigcerver(nn.Module):
    def __init__(self, n_out, height):
        super().__init__()
        chans = [1, 16, 32, 48, 64, 80]
        layers = []
        for i in range(5):
            if i >= 2:
                layers.append(nn.Dropout(0.2))
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, padding=1), nn.BatchNorm2d(chans[i + 1]),
                       nn.LeakyReLU(0.01, inplace=True)]
            if i < 3:
                layers.append(nn.MaxPool2d(2))
        self.cnn = nn.Sequential(*layers)
        self.blstm = nn.LSTM(80 * (height // 8), 256, num_layers=5, bidirectional=True, dropout=0.5)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(512, n_out)

    def forward(self, x):
        f = self.cnn(x)
        b, c, h, w = f.shape
        f = f.permute(3, 0, 1, 2).reshape(w, b, c * h)  # T, B, F
        f, _ = self.blstm(f)
        return self.out(self.drop(f))  # T, B, C


def ctc_greedy(logp, charset):
    best = logp.argmax(-1).transpose(0, 1).cpu().tolist()
    res = []
    for seq in best:
        s, prev = [], 0
        for k in seq:
            if k != prev and k != 0:
                s.append(charset[k - 1])
            prev = k
        res.append("".join(s))
    return res


@torch.no_grad()
def run_eval(net, loader, charset, device):
    net.eval()
    acc = torch.zeros(4, dtype=torch.float64, device=device)  # char err, chars, word err, words
    for x, _, _, texts in loader:
        preds = ctc_greedy(net(x.to(device)).log_softmax(-1), charset)
        for p, t in zip(preds, texts):
            acc[0] += Levenshtein.distance(p, t)
            acc[1] += len(t)
            acc[2] += float(p != t)
            acc[3] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item(), (acc[2] / acc[3]).item()


def main():
    args = cli()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lr_)

    if args.charset:
        with open(args.charset, encoding="utf-8") as f:
            charset = json.load(f)
    else:
        with open(os.path.join(args.data, "train.json"), encoding="utf-8") as f:
            charset = sorted({c for it in json.load(f) for c in normalize(it["text"])})

    train_ds = RimesWords(args.data, "train", charset, args.height, args.width, augment=True)
    valid_ds = RimesWords(args.data, "valid", charset, args.height, args.width)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6, collate_fn=collate,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                          batch_size=64, num_workers=4, collate_fn=collate)

    net = Puigcerver(len(charset) + 1, args.height).to(dev)
    net = DDP(net, device_ids=[lr_])
    opt = torch.optim.RMSprop(net.parameters(), lr=args.lr)
    ctc = nn.CTCLoss(zero_infinity=True)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        with open(os.path.join(args.save_dir, "charset.json"), "w", encoding="utf-8") as f:
            json.dump(charset, f, ensure_ascii=False)

    best_cer, bad_epochs = 1e9, 0
    for epoch in range(args.epochs):
        net.train()
        tot = torch.zeros(2, device=dev)
        for x, y, ylen, _ in train_dl:
            x = x.to(dev, non_blocking=True)
            logp = net(x).log_softmax(-1)
            il = torch.full((x.size(0),), logp.size(0), dtype=torch.long)
            loss = ctc(logp, y, il, ylen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot[0] += loss.detach()
            tot[1] += 1
        dist.all_reduce(tot)
        cer, wer = run_eval(net.module, valid_dl, charset, dev)
        if rank == 0:
            print(f"epoch {epoch:3d} | train ctc {tot[0].item() / tot[1].item():.4f} | "
                  f"valid CER {cer * 100:.2f} WER {wer * 100:.2f}", flush=True)
        if cer < best_cer:
            best_cer, bad_epochs = cer, 0
            if rank == 0:
                torch.save({"epoch": epoch, "state_dict": net.module.state_dict(), "charset": charset,
                            "cer": cer}, os.path.join(args.save_dir, "best.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                if rank == 0:
                    print(f"early stop at epoch {epoch}, best CER {best_cer * 100:.2f}")
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
