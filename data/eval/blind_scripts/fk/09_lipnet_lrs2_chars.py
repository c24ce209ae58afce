# LipNet-style sentence-level lip reading on LRS2 (visual only), character CTC.
#
#   torchrun --nproc_per_node=4 09_lipnet_lrs2_chars.py --lrs2 /data/LRS2 --run runs/lipnet_lrs2
#
import argparse
import json
import os
import time

import cv2
import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lrs2", required=True, help="LRS2 root with main/, pretrain/ and *.txt lists")
    ap.add_argument("--run", default="runs/lipnet_lrs2")
    ap.add_argument("--max-frames", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def read_split(root, split):
    items = []
    with open(os.path.join(root, f"{split}.txt")) as f:
        for line in f:
            key = line.split()[0]
            with open(os.path.join(root, "main", key + ".txt")) as g:
                text = g.readline().split(":", 1)[1].strip().lower()
            items.append((os.path.join(root, "main", key + ".mp4"), text))
    return items


class LRS2Lips(Dataset):
    def __init__(self, items, char2idx, max_frames, train):
        self.items = items
        self.char2idx = char2idx
        self.max_frames = max_frames
        self.train = train

    def __len__(self):
        return len(self.items)

    def _read(self, path):
        cap = cv2.VideoCapture(path)
        frames = []
        while True:
            ok, img = cap.read()
            if not ok:
                break
            gray = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
            frames.append(gray[115:195, 80:176])  # fixed mouth box on the 160x160 face crops
        cap.release()
        return np.stack(frames[: self.max_frames]).astype(np.float32) / 255.0

    def __getitem__(self, i):
        path, text = self.items[i]
        v = self._read(path)
        if self.train and np.random.rand() < 0.5:
            v = v[:, :, ::-1]
        v = torch.from_numpy(np.ascontiguousarray(v)).float()
        v = (v - v.mean()) / (v.std() + 1e-6)
        y = torch.tensor([self.char2idx[c] for c in text if c in self.char2idx], dtype=torch.long)
        return v, y


def collate(batch):
    vs, ys = zip(*batch)
    T = max(v.size(0) for v in vs)
    x = torch.zeros(len(vs), 1, T, vs[0].size(1), vs[0].size(2))
    for i, v in enumerate(vs):
        x[i, 0, : v.size(0)] = v
    return x, torch.tensor([v.size(0) for v in vs]), torch.cat(ys), torch.tensor([y.numel() for y in ys])


class LipNet(nn.Module):
    def __init__(self, n_class, drop=0.5):
        super().__init__()
        self.conv1 = nn.Conv3d(1, 32, (3, 5, 5), (1, 2, 2), (1, 2, 2))
        self.conv2 = nn.Conv3d(32, 64, (3, 5, 5), (1, 1, 1), (1, 2, 2))
        self.conv3 = nn.Conv3d(64, 96, (3, 3, 3), (1, 1, 1), (1, 1, 1))
        self.pool = nn.MaxPool3d((1, 2, 2), (1, 2, 2))
        self.drop3d = nn.Dropout3d(drop)
        self.gru1 = nn.GRU(96 * 5 * 6, 256, batch_first=True, bidirectional=True)
        self.gru2 = nn.GRU(512, 256, batch_first=True, bidirectional=True)
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(512, n_class)

    def forward(self, x, lens):
        x = self.pool(self.drop3d(F.relu(self.conv1(x))))
        x = self.pool(self.drop3d(F.relu(self.conv2(x))))
        x = self.pool(self.drop3d(F.relu(self.conv3(x))))
        b, c, t = x.shape[:3]
        x = x.permute(0, 2, 1, 3, 4).reshape(b, t, -1)
        packed = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.gru1(packed)
        h, _ = self.gru2(h)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=t)
        return self.fc(self.drop(h)).log_softmax(-1)


def ctc_greedy(logp, lens, idx2char):
    outs = []
    for seq, n in zip(logp.argmax(-1).tolist(), lens.tolist()):
        prev, s = 0, []
        for c in seq[:n]:
            if c != prev and c != 0:
                s.append(idx2char[c])
            prev = c
        outs.append("".join(s))
    return outs


@torch.no_grad()
def evaluate(model, loader, idx2char, device):
    model.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # char errs, chars, word errs, words
    for x, lens, ys, ylens in loader:
        logp = model(x.to(device), lens.to(device))
        hyps = ctc_greedy(logp.cpu(), lens, idx2char)
        off = 0
        for h, n in zip(hyps, ylens.tolist()):
            ref = "".join(idx2char[c] for c in ys[off:off + n].tolist())
            off += n
            stats += torch.tensor([editdistance.eval(h, ref), len(ref),
                                   editdistance.eval(h.split(), ref.split()), len(ref.split())],
                                  dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)
    np.random.seed(rank)

    train_items = read_split(args.lrs2, "train")
    val_items = read_split(args.lrs2, "val")
    alphabet = set("".join(t for _, t in train_items))
    char2idx = {c: i + 1 for i, c in enumerate(alphabet)}  # 0 = CTC blank
    idx2char = {i: c for c, i in char2idx.items()}

    train_ds = LRS2Lips(train_items, char2idx, args.max_frames, train=True)
    val_ds = Subset(LRS2Lips(val_items, char2idx, args.max_frames, train=False),
                    range(rank, len(val_items), world))
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, collate_fn=collate, num_workers=args.workers)

    model = LipNet(len(char2idx) + 1).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=3)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    writer = None
    if rank == 0:
        os.makedirs(args.run, exist_ok=True)
        writer = SummaryWriter(args.run)
        with open(os.path.join(args.run, "vocab.json"), "w") as f:
            json.dump(char2idx, f)

    best_wer, step = 1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, lens, ys, ylens in train_dl:
            x, lens = x.to(device, non_blocking=True), lens.to(device)
            ys, ylens = ys.to(device), ylens.to(device)
            logp = model(x, lens)
            loss = ctc(logp.transpose(0, 1), ys, lens, ylens)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 400.0)
            opt.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/ctc", loss.item(), step)

        cer, wer = evaluate(model.module, val_dl, idx2char, device)
        sched.step(wer)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val CER {100 * cer:.2f} WER {100 * wer:.2f}", flush=True)
            writer.add_scalar("val/cer", cer, epoch)
            writer.add_scalar("val/wer", wer, epoch)
            torch.save({"model": model.module.state_dict(), "vocab": char2idx, "epoch": epoch},
                       os.path.join(args.run, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save({"model": model.module.state_dict(), "vocab": char2idx, "epoch": epoch},
                           os.path.join(args.run, "best.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
