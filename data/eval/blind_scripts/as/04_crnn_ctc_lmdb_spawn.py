"""CRNN + CTC text-line recognition trained on LMDB datasets (MJSynth / SynthText crops).

Single node, one process per GPU via torch.multiprocessing.spawn:
    python train_crnn.py --train-lmdb /data/lmdb/mjsynth --val-lmdb /data/lmdb/iiit5k --gpus 4
"""
import argparse
import os
import io
import string

import lmdb
import numpy as np
import six
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler

ALPHABET = string.digits + string.ascii_lowercase


class LmdbTextLines(Dataset):
    """Standard deep-text-recognition-benchmark LMDB layout: num-samples, image-%09d, label-%09d."""

    def __init__(self, root, img_h=32, img_w=100, max_len=25):
        self.root = root
        self.img_h, self.img_w, self.max_len = img_h, img_w, max_len
        env = lmdb.open(root, readonly=True, lock=False, readahead=False, meminit=False)
        with env.begin(write=False) as txn:
            self.n = int(txn.get(b"num-samples"))
        env.close()
        self.env = None  # opened lazily inside each worker

    def __len__(self):
        return self.n

    def _open(self):
        self.env = lmdb.open(self.root, readonly=True, lock=False, readahead=False, meminit=False)

    def __getitem__(self, idx):
        if self.env is None:
            self._open()
        i = idx + 1
        with self.env.begin(write=False) as txn:
            label = txn.get(b"label-%09d" % i).decode("utf-8").lower()
            buf = six.BytesIO(txn.get(b"image-%09d" % i))
        img = Image.open(buf).convert("L").resize((self.img_w, self.img_h), Image.BILINEAR)
        label = "".join(c for c in label if c in ALPHABET)[: self.max_len]
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).unsqueeze(0)
        return x, label


class CTCCodec:
    def __init__(self, alphabet):
        self.alphabet = alphabet
        self.char2idx = {c: i + 1 for i, c in enumerate(alphabet)}  # 0 = blank

    def encode(self, texts):
        lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
        flat = torch.tensor([self.char2idx[c] for t in texts for c in t], dtype=torch.long)
        return flat, lengths

    def decode(self, idx_seq):
        out, prev = [], 0
        for i in idx_seq:
            if i != 0 and i != prev:
                out.append(self.alphabet[i - 1])
            prev = i
        return "".join(out)


def collate(batch):
    imgs, labels = zip(*batch)
    return torch.stack(imgs), list(labels)


class CRNN(nn.Module):
    def __init__(self, num_classes, nh=256):
        super().__init__()

        def block(cin, cout, bn=False):
            layers = [nn.Conv2d(cin, cout, 3, 1, 1)]
            if bn:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU(inplace=True))
            return layers

        self.cnn = nn.Sequential(
            *block(1, 64), nn.MaxPool2d(2, 2),
            *block(64, 128), nn.MaxPool2d(2, 2),
            *block(128, 256, True), *block(256, 256), nn.MaxPool2d((2, 1), (2, 1)),
            *block(256, 512, True), *block(512, 512), nn.MaxPool2d((2, 1), (2, 1)),
            nn.Conv2d(512, 512, 2, 1, 0), nn.BatchNorm2d(512), nn.ReLU(inplace=True),
        )
        self.rnn = nn.LSTM(512, nh, num_layers=2, bidirectional=True, batch_first=False)
        self.fc = nn.Linear(nh * 2, num_classes)

    def forward(self, x):
        f = self.cnn(x)               # B, 512, 1, W'
        f = f.squeeze(2).permute(2, 0, 1)  # T, B, C
        f, _ = self.rnn(f)
        return self.fc(f)             # T, B, num_classes


def train_worker(args, rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    codec = CTCCodec(ALPHABET)
    train_ds = LmdbTextLines(args.train_lmdb)
    val_ds = LmdbTextLines(args.val_lmdb)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate, pin_memory=True,
                              drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=4,
                            collate_fn=collate)

    model = CRNN(num_classes=len(ALPHABET) + 1).to(device)
    model = DDP(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[200_000, 280_000], gamma=0.1)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    it, epoch, best_acc = 0, 0, 0.0
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        model.train()
        for imgs, texts in train_loader:
            imgs = imgs.to(device, non_blocking=True)
            targets, tgt_lens = codec.encode(texts)
            logits = model(imgs)
            log_probs = logits.log_softmax(2)
            in_lens = torch.full((imgs.size(0),), log_probs.size(0), dtype=torch.long)
            loss = ctc(log_probs, targets, in_lens, tgt_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0 and it % 200 == 0:
                print(f"it {it} loss {loss.item():.4f}", flush=True)
            if it % args.val_every == 0:
                acc, char_acc = validate(model, val_loader, codec, device)
                if rank == 0:
                    print(f"it {it} word acc {acc:.4f} char acc {char_acc:.4f}", flush=True)
                    if acc > best_acc:
                        best_acc = acc
                        torch.save({"model": model.module.state_dict(), "iter": it, "acc": acc},
                                   os.path.join(args.out, "crnn_best.pth"))
                model.train()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


def edit_distance(a, b):
    d = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, d[0] = d[0], i
        for j, cb in enumerate(b, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (ca != cb))
    return d[len(b)]


@torch.no_grad()
def validate(model, loader, codec, device):
    model.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # correct, n, char_err, char_total
    for imgs, texts in loader:
        preds = model(imgs.to(device)).argmax(2).t().cpu().tolist()
        for p, t in zip(preds, texts):
            s = codec.decode(p)
            stats[0] += float(s == t)
            stats[1] += 1
            stats[2] += edit_distance(s, t)
            stats[3] += max(len(t), 1)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item(), (1 - stats[2] / stats[3]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-lmdb", required=True)
    p.add_argument("--val-lmdb", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--batch-size", type=int, default=192)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--iters", type=int, default=300_000)
    p.add_argument("--val-every", type=int, default=5000)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--seed", type=int, default=1111)
    p.add_argument("--out", default="checkpoints/crnn")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(train_worker, args=(args, args.gpus), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
