"""Text-line recognizer for receipt / invoice crops (Chinese + Latin), CTC head.

Layout of --data:
    charset.txt            one character per line (fixed, shared by every job)
    train/labels.tsv       relative_path \t transcription
    val/labels.tsv

Run:
    torchrun --nproc_per_node=8 06_crnn_receipts_gather_preds.py --data /nfs/ocr/receipts_v3 \
        --work-dir /nfs/ocr/exp/receipts_crnn --resume auto
"""
import argparse
import glob
import os
import re

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--img-h", type=int, default=48)
    p.add_argument("--img-w", type=int, default=480)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--resume", default="", help="path, or 'auto' for latest in work-dir")
    return p.parse_args()


def load_charset(path):
    with open(path, encoding="utf-8") as f:
        chars = [l.rstrip("\n") for l in f if l.rstrip("\n")]
    return chars


class LineSet(Dataset):
    def __init__(self, root, split, charset, img_h, img_w, train):
        self.root = os.path.join(root, split)
        self.c2i = {c: i + 1 for i, c in enumerate(charset)}
        self.img_h, self.img_w, self.train = img_h, img_w, train
        # CTC needs T >= 2L+1 in the worst case; T = img_w / 4
        max_label = (img_w // 4 - 1) // 2
        self.items = []
        with open(os.path.join(self.root, "labels.tsv"), encoding="utf-8") as f:
            for line in f:
                rel, text = line.rstrip("\n").split("\t", 1)
                ids = [self.c2i[c] for c in text if c in self.c2i]
                if 0 < len(ids) <= max_label:
                    self.items.append((rel, text, ids))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rel, text, ids = self.items[i]
        img = cv2.imread(os.path.join(self.root, rel), cv2.IMREAD_COLOR)
        h, w = img.shape[:2]
        nw = min(self.img_w, max(16, int(w * self.img_h / h)))
        img = cv2.resize(img, (nw, self.img_h))
        if self.train and np.random.rand() < 0.3:
            img = cv2.GaussianBlur(img, (3, 3), 0)
        canvas = np.zeros((self.img_h, self.img_w, 3), np.float32)
        canvas[:, :nw] = (img.astype(np.float32) / 255.0 - 0.5) / 0.5
        return torch.from_numpy(canvas).permute(2, 0, 1), torch.tensor(ids), text


def collate(b):
    x, y, t = zip(*b)
    return torch.stack(x), torch.cat(y), torch.tensor([len(i) for i in y]), list(t)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        def blk(i, o, s):
            return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True),
                                 nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True))
        self.net = nn.Sequential(blk(3, 64, 2), blk(64, 128, 2), blk(128, 256, (2, 1)), blk(256, 384, (2, 1)),
                                 nn.AdaptiveAvgPool2d((1, None)))

    def forward(self, x):
        return self.net(x).squeeze(2).transpose(1, 2)  # B, T, C


class Recognizer(nn.Module):
    def __init__(self, charset):
        super().__init__()
        self.charset = charset
        self.backbone = Backbone()
        self.rnn = nn.LSTM(384, 256, 2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(512, len(charset) + 1)

    def forward(self, x):
        f, _ = self.rnn(self.backbone(x))
        return self.head(f)

    def decode(self, logits):
        res = []
        for seq in logits.argmax(-1).tolist():
            out, prev = [], 0
            for k in seq:
                if k and k != prev:
                    out.append(self.charset[k - 1])
                prev = k
            res.append("".join(out))
        return res


def find_latest(work_dir):
    ck = glob.glob(os.path.join(work_dir, "epoch_*.pth"))
    if not ck:
        return ""
    return max(ck, key=lambda p: int(re.findall(r"epoch_(\d+)", p)[0]))


@torch.no_grad()
def evaluate(model, loader, rank):
    net = model.module
    net.eval()
    local = []
    for x, _, _, texts in loader:
        preds = net.decode(net(x.cuda(non_blocking=True)))
        local.extend(zip(preds, texts))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    net.train()
    if rank != 0:
        return None
    pairs = [p for part in gathered for p in part]
    line_acc = sum(p == t for p, t in pairs) / max(len(pairs), 1)
    return line_acc, pairs[:20]


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(2024)
    np.random.seed(2024 + rank)

    charset = load_charset(os.path.join(a.data, "charset.txt"))
    train_set = LineSet(a.data, "train", charset, a.img_h, a.img_w, True)
    val_set = LineSet(a.data, "val", charset, a.img_h, a.img_w, False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # every val line is seen exactly once across ranks
    val_part = torch.utils.data.Subset(val_set, list(range(rank, len(val_set), world)))
    train_loader = DataLoader(train_set, a.batch, sampler=train_sampler, num_workers=8, pin_memory=True,
                              drop_last=True, collate_fn=collate)
    val_loader = DataLoader(val_part, 128, num_workers=4, collate_fn=collate)

    model = DDP(Recognizer(charset).cuda(), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(a.epochs * 0.6), int(a.epochs * 0.85)], gamma=0.1)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    start = 0
    ckpt_path = find_latest(a.work_dir) if a.resume == "auto" else a.resume
    if ckpt_path:
        ckpt = torch.load(ckpt_path, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start = ckpt["epoch"] + 1

    writer = None
    if rank == 0:
        os.makedirs(a.work_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(a.work_dir, "tb"))

    step = start * (len(train_loader) // a.accum)
    for epoch in range(start, a.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (x, y, ylen, _) in enumerate(train_loader):
            x = x.cuda(non_blocking=True)
            sync_now = (i + 1) % a.accum == 0
            with model.no_sync() if not sync_now else torch.enable_grad():
                lp = F.log_softmax(model(x), -1).transpose(0, 1)
                il = torch.full((x.size(0),), lp.size(0), dtype=torch.long)
                loss = ctc(lp, y, il, ylen) / a.accum
                loss.backward()
            if not sync_now:
                continue
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/ctc", loss.item() * a.accum, step)
                writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
        sched.step()

        res = evaluate(model, val_loader, rank)
        if rank == 0:
            acc, samples = res
            writer.add_scalar("val/line_acc", acc, epoch)
            writer.add_text("val/samples", "\n".join(f"{p} | {t}" for p, t in samples), epoch)
            print(f"epoch {epoch} line acc {acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(a.work_dir, f"epoch_{epoch}.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
