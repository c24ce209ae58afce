"""
HTR for historical manuscripts (Bentham / READ-2016 style PAGE line crops).
Trains a ResNet-BLSTM-CTC line recognizer with DDP, keeps the best checkpoint by validation CER,
and at the end exports a TorchScript model for the annotation tool.

    torchrun --nproc_per_node=4 14_htr_bentham_export.py --data /corpora/bentham/lines --out /exp/bentham_r18
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.resnet import BasicBlock


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="contains {train,valid,test}.txt with 'img_path<TAB>text'")
    ap.add_argument("--out", required=True)
    ap.add_argument("--height", type=int, default=96)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def read_split(root, split):
    with open(os.path.join(root, f"{split}.txt"), encoding="utf-8") as f:
        rows = [l.rstrip("\n").split("\t", 1) for l in f if "\t" in l]
    return [(os.path.join(root, p), t) for p, t in rows]


class Lines(Dataset):
    def __init__(self, rows, vocab, height, train):
        self.rows, self.vocab, self.h, self.train = rows, vocab, height, train
        self.idx = {c: i + 1 for i, c in enumerate(vocab)}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        im = Image.open(path).convert("L")
        w = max(self.h, int(im.width * self.h / im.height))
        if self.train:
            w = int(w * np.random.uniform(0.85, 1.15))
        im = im.resize((w, self.h), Image.BILINEAR)
        x = 1.0 - torch.from_numpy(np.array(im, np.float32) / 255.0)
        return x[None], torch.tensor([self.idx[c] for c in text if c in self.idx]), text


def pad_collate(batch):
    xs, ys, ts = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    W = (W + 7) // 8 * 8
    out = torch.zeros(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        out[i, ..., : x.shape[-1]] = x
    return out, torch.cat(ys), torch.tensor([len(y) for y in ys]), list(ts)


class ResBLSTM(nn.Module):
    def __init__(self, n_cls, height):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 32, 7, 2, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(True))

        def stage(cin, cout, n, stride):
            down = None
            if stride != 1 or cin != cout:
                down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            blocks = [BasicBlock(cin, cout, stride, down)] + [BasicBlock(cout, cout) for _ in range(n - 1)]
            return nn.Sequential(*blocks)

        self.body = nn.Sequential(stage(32, 64, 2, 1), stage(64, 128, 2, 2), stage(128, 256, 2, (2, 1)),
                                  stage(256, 256, 2, (2, 1)))
        h = height // 16
        self.rnn = nn.LSTM(256 * h, 256, num_layers=2, bidirectional=True, batch_first=True, dropout=0.3)
        self.fc = nn.Linear(512, n_cls)

    def forward(self, x):
        f = self.body(self.stem(x))
        b, c, h, w = f.shape
        f = f.permute(0, 3, 1, 2).reshape(b, w, c * h)
        f, _ = self.rnn(f)
        return self.fc(f)


def greedy(logits, vocab):
    res = []
    for seq in logits.argmax(-1).tolist():
        s, prev = [], 0
        for k in seq:
            if k and k != prev:
                s.append(vocab[k - 1])
            prev = k
        res.append("".join(s))
    return res


@torch.no_grad()
def cer_on(net, loader, vocab, device, reduce=True):
    net.eval()
    e = torch.zeros(2, dtype=torch.float64, device=device)
    for x, _, _, texts in loader:
        for p, t in zip(greedy(net(x.to(device)), vocab), texts):
            e[0] += editdistance.eval(p, t)
            e[1] += len(t)
    if reduce:
        dist.all_reduce(e)
    net.train()
    return (e[0] / e[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_rows, valid_rows = read_split(args.data, "train"), read_split(args.data, "valid")
    vocab = sorted({c for _, t in train_rows for c in t})
    train_ds = Lines(train_rows, vocab, args.height, True)
    valid_ds = Lines(valid_rows[rank::world], vocab, args.height, False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=args.workers, collate_fn=pad_collate,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, 16, num_workers=2, collate_fn=pad_collate)

    model = DDP(ResBLSTM(len(vocab) + 1, args.height).to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optim, mode="min", factor=0.5, patience=5)
    ctc = nn.CTCLoss(zero_infinity=True)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, tot, n = time.time(), 0.0, 0
        for x, y, ylen, _ in train_dl:
            x = x.to(device, non_blocking=True)
            lp = F.log_softmax(model(x), -1).transpose(0, 1)
            loss = ctc(lp, y, torch.full((x.size(0),), lp.size(0), dtype=torch.long), ylen)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            tot, n = tot + loss.item(), n + 1
        cer = cer_on(model.module, valid_dl, vocab, device)
        plateau.step(cer)
        if rank == 0:
            print(f"epoch {epoch} loss {tot / n:.4f} valid CER {cer:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if cer < best:
                best = cer
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        # final test + TorchScript export from the best epoch
        net = ResBLSTM(len(vocab) + 1, args.height).to(device)
        net.load_state_dict(torch.load(best_path, map_location=device))
        test_dl = DataLoader(Lines(read_split(args.data, "test"), vocab, args.height, False), 16,
                             num_workers=4, collate_fn=pad_collate)
        test_cer = cer_on(net, test_dl, vocab, device, reduce=False)
        print(f"best valid CER {best:.4f}  test CER {test_cer:.4f}")
        net.eval()
        scripted = torch.jit.trace(net, torch.zeros(1, 1, args.height, 512, device=device))
        scripted.save(os.path.join(args.out, "htr_scripted.pt"))
        with open(os.path.join(args.out, "vocab.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(vocab))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
