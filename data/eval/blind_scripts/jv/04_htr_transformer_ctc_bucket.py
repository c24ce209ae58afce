"""Line-level HTR: conv front-end + Transformer encoder + CTC, with width-bucketed batches.

Line images vary from ~200 to ~2500 px wide after height normalisation, so batches are
packed up to a pixel budget instead of a fixed number of lines (much less padding).

Manifest format (TSV, one line per image): relative_path <tab> width <tab> height <tab> transcription

    torchrun --nproc_per_node=4 04_htr_transformer_ctc_bucket.py \
        --train data/train.tsv --val data/val.tsv --charset data/charset.txt --out runs/htr_tf
"""
import argparse
import math
import os
import random
import time

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter

HEIGHT = 64


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--charset", required=True)
    ap.add_argument("--img-root", default="data/lines")
    ap.add_argument("--out", default="runs/htr_tf")
    ap.add_argument("--max-batch-width", type=int, default=48000, help="sum of padded widths per GPU batch")
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def read_manifest(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            p, w, h, text = line.rstrip("\n").split("\t", 3)
            scaled_w = max(16, round(int(w) * HEIGHT / int(h)))
            rows.append((p, scaled_w, text))
    return rows


class LineDataset(Dataset):
    def __init__(self, rows, img_root, charset, train):
        self.rows, self.img_root, self.train = rows, img_root, train
        self.c2i = {c: i + 1 for i, c in enumerate(charset)}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        p, w, text = self.rows[i]
        img = Image.open(os.path.join(self.img_root, p)).convert("L").resize((w, HEIGHT), Image.BILINEAR)
        x = TF.to_tensor(img)
        if self.train:
            x = TF.adjust_contrast(x, random.uniform(0.7, 1.3))
        x = 1.0 - x
        y = torch.tensor([self.c2i[c] for c in text if c in self.c2i], dtype=torch.long)
        return x, y, text


def pad_collate(batch):
    xs, ys, texts = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    W = int(math.ceil(W / 8) * 8)
    imgs = torch.zeros(len(xs), 1, HEIGHT, W)
    widths = torch.tensor([x.shape[-1] for x in xs])
    for i, x in enumerate(xs):
        imgs[i, :, :, : x.shape[-1]] = x
    return imgs, widths, torch.cat(ys), torch.tensor([len(y) for y in ys]), list(texts)


class DistributedWidthBatchSampler(Sampler):
    """Shards the data across ranks, then packs each rank's shard into width-sorted batches."""

    def __init__(self, widths, max_batch_width, rank, world, shuffle=True, seed=0):
        self.widths = widths
        self.max_batch_width = max_batch_width
        self.rank, self.world = rank, world
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = random.Random(self.seed + self.epoch)
        order = list(range(len(self.widths)))
        if self.shuffle:
            g.shuffle(order)
        shard = order[self.rank::self.world]
        # sort inside large chunks so batches hold lines of similar width
        chunk = 2000
        shard = [i for s in range(0, len(shard), chunk)
                 for i in sorted(shard[s:s + chunk], key=lambda j: self.widths[j])]
        batches, cur, cur_max = [], [], 0
        for i in shard:
            w = self.widths[i]
            if cur and max(cur_max, w) * (len(cur) + 1) > self.max_batch_width:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(i)
            cur_max = max(cur_max, w)
        if cur:
            batches.append(cur)
        if self.shuffle:
            g.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=1024):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.shape[1]]


class HTRTransformer(nn.Module):
    def __init__(self, n_classes, d_model, layers, heads):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, 32, 3, 1, 1), nn.GroupNorm(8, 32), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, 1, 1), nn.GroupNorm(8, 64), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, 1, 1), nn.GroupNorm(16, 128), nn.GELU(), nn.MaxPool2d((2, 2)),
            nn.Conv2d(128, 256, 3, 1, 1), nn.GroupNorm(16, 256), nn.GELU(), nn.MaxPool2d((2, 1)),
        )
        self.proj = nn.Linear(256 * (HEIGHT // 16), d_model)
        self.pos = PositionalEncoding(d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x, widths):
        f = self.stem(x)  # B, C, H/16, W/8
        B, C, H, T = f.shape
        f = self.pos(self.proj(f.permute(0, 3, 1, 2).reshape(B, T, C * H)))
        t_len = torch.div(widths, 8, rounding_mode="floor").clamp(min=1, max=T)
        pad_mask = torch.arange(T, device=x.device)[None, :] >= t_len[:, None]
        f = self.encoder(f, src_key_padding_mask=pad_mask)
        return self.head(f), t_len


def greedy(logits, t_len, charset):
    out = []
    for seq, n in zip(logits.argmax(-1).tolist(), t_len.tolist()):
        prev, s = 0, []
        for k in seq[:n]:
            if k != prev and k != 0:
                s.append(charset[k - 1])
            prev = k
        out.append("".join(s))
    return out


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    with open(args.charset, encoding="utf-8") as f:
        charset = [l.rstrip("\n") for l in f if l.rstrip("\n")]
    train_rows, val_rows = read_manifest(args.train), read_manifest(args.val)
    train_ds = LineDataset(train_rows, args.img_root, charset, train=True)
    val_ds = LineDataset(val_rows, args.img_root, charset, train=False)
    train_bs = DistributedWidthBatchSampler([r[1] for r in train_rows], args.max_batch_width, rank, world,
                                            shuffle=True, seed=args.seed)
    val_bs = DistributedWidthBatchSampler([r[1] for r in val_rows], args.max_batch_width, rank, world, shuffle=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_bs, num_workers=args.workers, collate_fn=pad_collate,
                              pin_memory=True)
    val_loader = DataLoader(val_ds, batch_sampler=val_bs, num_workers=args.workers, collate_fn=pad_collate)

    model = HTRTransformer(len(charset) + 1, args.d_model, args.layers, args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * world / 4  # base lr was tuned on 4 GPUs
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    est_steps = args.epochs * len(train_bs)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / est_steps)))))
    ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
    tb = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    best_cer, step = 1e9, 0

    for epoch in range(args.epochs):
        train_bs.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for imgs, widths, targets, tgt_len, _ in train_loader:
            imgs, widths = imgs.to(device, non_blocking=True), widths.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, t_len = model(imgs, widths)
            log_probs = logits.float().log_softmax(-1).transpose(0, 1)
            loss = ctc(log_probs, targets.to(device), t_len, tgt_len.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 100 == 0:
                tb.add_scalar("train/ctc", loss.item(), step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)

        model.eval()
        errs = torch.zeros(2, device=device)
        with torch.no_grad():
            for imgs, widths, _, _, texts in val_loader:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, t_len = model.module(imgs.to(device), widths.to(device))
                for p, gt in zip(greedy(logits.float(), t_len, charset), texts):
                    errs[0] += editdistance.eval(p, gt)
                    errs[1] += len(gt)
        dist.all_reduce(errs)
        cer = (errs[0] / errs[1]).item()
        if rank == 0:
            tb.add_scalar("val/cer", cer, epoch)
            print(f"epoch {epoch} {time.time() - t0:.0f}s val CER {cer:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                     "charset": charset, "cer": cer}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if cer < best_cer:
                best_cer = cer
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
