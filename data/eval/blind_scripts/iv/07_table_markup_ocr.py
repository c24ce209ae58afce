"""Image-to-markup with width bucketing.

Formula images vary from ~40px to >1000px wide; padding every batch to the widest image in a
random batch wastes most of the compute, so batches are built from images of similar width.

    torchrun --nproc_per_node=4 07_table_markup_ocr.py --data data/im2latex --bucket_width 64
"""
import argparse
import json
import math
import os
import random
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
import torchvision.transforms.functional as TF
from torch.utils.tensorboard import SummaryWriter


def options():
    o = argparse.ArgumentParser()
    o.add_argument("--data", default="data/im2latex")
    o.add_argument("--logdir", default="runs/bucketed")
    o.add_argument("--epochs", type=int, default=25)
    o.add_argument("--tokens_per_batch", type=int, default=6000, help="image columns x batch, per GPU")
    o.add_argument("--bucket_width", type=int, default=64)
    o.add_argument("--lr", type=float, default=4e-4)
    o.add_argument("--height", type=int, default=64)
    o.add_argument("--d", type=int, default=256)
    o.add_argument("--max_len", type=int, default=160)
    o.add_argument("--seed", type=int, default=42)
    return o.parse_args()


class Formulas(Dataset):
    def __init__(self, root, split, vocab, height, max_len):
        meta = json.load(open(os.path.join(root, f"{split}_meta.json")))   # [{"img", "w", "h", "tex"}]
        self.items = [m for m in meta if len(m["tex"].split()) + 2 <= max_len]
        self.root, self.vocab, self.height = root, vocab, height
        # width after resizing to a fixed height; used by the bucket sampler
        self.widths = [max(8, round(m["w"] * height / m["h"])) for m in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        m = self.items[i]
        im = Image.open(os.path.join(self.root, "images", m["img"])).convert("L")
        im = im.resize((self.widths[i], self.height), Image.BILINEAR)
        ids = [1] + [self.vocab.get(t, 3) for t in m["tex"].split()] + [2]
        return TF.to_tensor(im), torch.tensor(ids)


class DistributedBucketSampler(Sampler):
    """Groups indices by resized width, cuts each bucket into batches whose padded size stays
    under `tokens_per_batch`, shuffles the batch list (same seed on every rank) and deals the
    batches out round-robin to the ranks."""

    def __init__(self, widths, bucket_width, tokens_per_batch, rank, world_size, seed=0, shuffle=True):
        self.widths, self.rank, self.world = widths, rank, world_size
        self.bucket_width, self.tpb = bucket_width, tokens_per_batch
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0
        self.batches = self._make_batches(random.Random(seed))

    def _make_batches(self, rng):
        buckets = defaultdict(list)
        for i, w in enumerate(self.widths):
            buckets[w // self.bucket_width].append(i)
        batches = []
        for b in sorted(buckets):
            idx = buckets[b]
            rng.shuffle(idx)
            per = max(1, self.tpb // ((b + 1) * self.bucket_width))
            batches += [idx[k:k + per] for k in range(0, len(idx), per)]
        return batches

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        batches = self._make_batches(rng) if self.shuffle else list(self.batches)
        if self.shuffle:
            rng.shuffle(batches)
        return iter(batches[self.rank::self.world])

    def __len__(self):
        return math.ceil(len(self.batches) / self.world)


def collate(batch):
    xs, ys = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    img = torch.ones(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        img[i, ..., : x.shape[-1]] = x
    return img, nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=0)


class ConvStem(nn.Module):
    def __init__(self, d):
        super().__init__()
        ch = [1, 64, 128, 256, d]
        layers = []
        for i in range(4):
            layers += [nn.Conv2d(ch[i], ch[i + 1], 3, padding=1), nn.GroupNorm(8, ch[i + 1]), nn.GELU(),
                       nn.MaxPool2d(2)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)     # H/16, W/16


class Seq2Seq(nn.Module):
    def __init__(self, vocab_size, d, max_len):
        super().__init__()
        self.stem = ConvStem(d)
        self.row_pos = nn.Embedding(16, d)
        self.col_pos = nn.Embedding(256, d)
        self.transformer = nn.Transformer(d, 8, num_encoder_layers=3, num_decoder_layers=3,
                                          dim_feedforward=4 * d, batch_first=True)
        self.emb = nn.Embedding(vocab_size, d, padding_idx=0)
        self.tpos = nn.Embedding(max_len, d)
        self.out = nn.Linear(d, vocab_size)

    def forward(self, img, tgt_in):
        f = self.stem(img)
        B, C, H, W = f.shape
        pos = self.row_pos.weight[:H, None, :] + self.col_pos.weight[None, :W, :]
        src = f.permute(0, 2, 3, 1) + pos
        src = src.reshape(B, H * W, C)
        L = tgt_in.shape[1]
        tgt = self.emb(tgt_in) + self.tpos.weight[:L]
        mask = self.transformer.generate_square_subsequent_mask(L, device=img.device)
        h = self.transformer(src, tgt, tgt_mask=mask, tgt_key_padding_mask=tgt_in.eq(0))
        return self.out(h)


@torch.no_grad()
def val_loss_and_acc(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)     # sum nll, correct tokens, tokens
    for img, y in loader:
        img, y = img.to(device), y.to(device)
        logits = model(img, y[:, :-1])
        tgt = y[:, 1:]
        valid = tgt.ne(0)
        s[0] += F.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=0, reduction="sum")
        s[1] += (logits.argmax(-1).eq(tgt) & valid).sum()
        s[2] += valid.sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = options()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    itos = json.load(open(os.path.join(args.data, "vocab.json")))
    vocab = {t: i for i, t in enumerate(itos)}
    train_ds = Formulas(args.data, "train", vocab, args.height, args.max_len)
    val_ds = Formulas(args.data, "val", vocab, args.height, args.max_len)
    train_bs = DistributedBucketSampler(train_ds.widths, args.bucket_width, args.tokens_per_batch, rank, world,
                                        seed=args.seed)
    val_bs = DistributedBucketSampler(val_ds.widths, args.bucket_width, args.tokens_per_batch, rank, world,
                                      shuffle=False)
    train_dl = DataLoader(train_ds, batch_sampler=train_bs, collate_fn=collate, num_workers=6, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_sampler=val_bs, collate_fn=collate, num_workers=2)

    model = DDP(Seq2Seq(len(itos), args.d, args.max_len).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * len(train_bs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps + 10, pct_start=0.04)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    gstep = 0
    for epoch in range(args.epochs):
        train_bs.set_epoch(epoch)
        for img, y in train_dl:
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img, y[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), y[:, 1:], ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            gstep += 1
            if writer and gstep % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), gstep)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], gstep)

        vloss, vacc = val_loss_and_acc(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: val loss {vloss:.4f} token acc {vacc:.4f}", flush=True)
            writer.add_scalar("val/loss", vloss, epoch)
            writer.add_scalar("val/token_acc", vacc, epoch)
            torch.save({"model": model.module.state_dict(), "itos": itos, "epoch": epoch},
                       os.path.join(args.logdir, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
