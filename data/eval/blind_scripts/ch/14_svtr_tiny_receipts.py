"""SVTR-Tiny style recognizer (conv-stem + mixing blocks + CTC) for Chinese/English receipt text lines.

    torchrun --nproc_per_node=8 14_svtr_tiny_receipts.py --data-root /data/rec_lines \
        --dict ppocr_keys_v1.txt --run-name svtr_tiny_receipts
"""
import argparse
import os
import time

import cv2
import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def load_dict(path):
    with open(path, encoding="utf-8") as f:
        chars = [l.rstrip("\r\n") for l in f]
    return ["<blank>"] + chars + [" "]


class RecDataset(Dataset):
    """PaddleOCR-style label file: <img_path>\t<text>"""

    def __init__(self, root, label_file, c2i, shape=(48, 320)):
        with open(os.path.join(root, label_file), encoding="utf-8") as f:
            self.items = [l.rstrip("\n").split("\t", 1) for l in f if "\t" in l]
        self.root, self.c2i, (self.h, self.w) = root, c2i, shape

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        img = cv2.imread(os.path.join(self.root, path))
        h, w = img.shape[:2]
        nw = min(self.w, int(np.ceil(self.h * w / h)))
        img = cv2.resize(img, (nw, self.h)).astype(np.float32) / 255.0
        canvas = np.zeros((self.h, self.w, 3), np.float32)
        canvas[:, :nw] = (img - 0.5) / 0.5
        label = [self.c2i[c] for c in text if c in self.c2i][:40]
        return torch.from_numpy(canvas).permute(2, 0, 1), torch.tensor(label, dtype=torch.long), text


def collate(batch):
    x, y, texts = zip(*batch)
    return torch.stack(x), torch.cat(y), torch.tensor([len(t) for t in y]), list(texts)


class MixBlock(nn.Module):
    def __init__(self, dim, heads, mixer, hw):
        super().__init__()
        self.mixer, self.hw = mixer, hw
        self.n1 = nn.LayerNorm(dim)
        if mixer == "global":
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        else:
            self.local = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    def forward(self, x):
        h, w = self.hw
        y = self.n1(x)
        if self.mixer == "global":
            y = self.attn(y, y, y, need_weights=False)[0]
        else:
            B, N, C = y.shape
            y = self.local(y.transpose(1, 2).reshape(B, C, h, w)).flatten(2).transpose(1, 2)
        x = x + y
        return x + self.mlp(self.n2(x))


class SVTRTiny(nn.Module):
    def __init__(self, n_classes, img=(48, 320), dims=(64, 128, 256), depths=(3, 6, 3), heads=(2, 4, 8)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0] // 2, 3, 2, 1), nn.GELU(),
                                  nn.Conv2d(dims[0] // 2, dims[0], 3, 2, 1), nn.GELU())
        h, w = img[0] // 4, img[1] // 4
        self.pos = nn.Parameter(torch.zeros(1, h * w, dims[0]))
        self.stages, self.merges, self.hws = nn.ModuleList(), nn.ModuleList(), []
        for s, (d, n, nh) in enumerate(zip(dims, depths, heads)):
            mixers = ["local"] * (n // 2) + ["global"] * (n - n // 2) if s < 2 else ["global"] * n
            self.stages.append(nn.Sequential(*[MixBlock(d, nh, m, (h, w)) for m in mixers]))
            self.hws.append((h, w))
            if s < 2:
                self.merges.append(nn.Conv2d(d, dims[s + 1], 3, (2, 1), 1))
                h = (h + 1) // 2
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], n_classes)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2) + self.pos
        for s, stage in enumerate(self.stages):
            x = stage(x)
            h, w = self.hws[s]
            if s < 2:
                B, N, C = x.shape
                x = self.merges[s](x.transpose(1, 2).reshape(B, C, h, w)).flatten(2).transpose(1, 2)
        B, N, C = x.shape
        h, w = self.hws[-1]
        x = self.norm(x).reshape(B, h, w, C).mean(1)  # collapse height -> B, W, C
        return self.head(x)


def ctc_decode(logits, i2c):
    out = []
    for row in logits.argmax(-1).cpu().tolist():
        prev, s = 0, []
        for k in row:
            if k and k != prev:
                s.append(i2c[k])
            prev = k
        out.append("".join(s))
    return out


@torch.no_grad()
def evaluate(model, loader, i2c, device):
    model.eval()
    m = torch.zeros(3, device=device, dtype=torch.float64)
    for x, _, _, texts in loader:
        preds = ctc_decode(model(x.to(device, non_blocking=True)), i2c)
        for p, g in zip(preds, texts):
            m[0] += float(p == g)
            m[1] += 1 - editdistance.eval(p, g) / max(len(p), len(g), 1)
            m[2] += 1
    dist.all_reduce(m)
    model.train()
    return (m[0] / m[2]).item(), (m[1] / m[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--dict", required=True)
    ap.add_argument("--run-name", default="svtr_tiny")
    ap.add_argument("--project", default="ocr-rec")
    ap.add_argument("--out", default="output/svtr_tiny")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    chars = load_dict(args.dict)
    c2i = {c: i for i, c in enumerate(chars)}
    i2c = dict(enumerate(chars))
    train_ds = RecDataset(args.data_root, "train_list.txt", c2i)
    val_ds = RecDataset(args.data_root, "val_list.txt", c2i)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, collate_fn=collate, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256,
                        collate_fn=collate, num_workers=4)

    model = DDP(SVTRTiny(len(chars)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.05)
    total = args.epochs * len(train_dl)
    warm = 2 * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / (total - warm))))
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y, ylen, _ in train_dl:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            logp = logits.float().log_softmax(-1).permute(1, 0, 2)
            loss = ctc(logp, y, torch.full((x.shape[0],), logp.shape[0], dtype=torch.long), ylen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        acc, norm_ed = evaluate(model, val_dl, i2c, device)
        wandb.log({"val/acc": acc, "val/1-NED": norm_ed, "epoch_time": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} acc {acc:.4f} 1-NED {norm_ed:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "dict": chars, "epoch": epoch},
                       os.path.join(args.out, "latest.pth"))
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "dict": chars, "epoch": epoch},
                           os.path.join(args.out, "best_accuracy.pth"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
