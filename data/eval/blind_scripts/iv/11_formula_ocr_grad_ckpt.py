"""Large formula OCR model (conv stem + 12-layer Transformer decoder) with activation
checkpointing and gradient accumulation. Tokenised labels are cached on first run.

    torchrun --nproc_per_node=8 11_formula_ocr_grad_ckpt.py --root data/im2latex-230k --accum 4
"""
import argparse
import math
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision.transforms.functional as TF

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/im2latex-230k")
    p.add_argument("--run_dir", default="runs/large_ckpt")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--micro_bs", type=int, default=12)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--max_len", type=int, default=256)
    p.add_argument("--grad_ckpt", action="store_true", default=True)
    return p.parse_args()


def build_label_cache(root, max_len, out_file):
    """One pass over the label files: vocab (sorted, stable across runs) and token ids."""
    splits = {}
    for split in ("train", "val"):
        with open(os.path.join(root, f"{split}.tsv"), encoding="utf-8") as f:
            splits[split] = [line.rstrip("\n").split("\t", 1) for line in f]
    counts = Counter(t for _, tex in splits["train"] for t in tex.split())
    itos = SPECIAL + sorted(t for t, c in counts.items() if c >= 2)
    stoi = {t: i for i, t in enumerate(itos)}
    cache = {"itos": itos}
    for split, rows in splits.items():
        cache[split] = [(img, [1] + [stoi.get(t, 3) for t in tex.split()][: max_len - 2] + [2]) for img, tex in rows]
    tmp = out_file + ".tmp"
    torch.save(cache, tmp)
    os.replace(tmp, out_file)


class FormulaSet(Dataset):
    def __init__(self, root, rows, height):
        self.root, self.rows, self.height = root, rows, height

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        img, ids = self.rows[i]
        im = Image.open(os.path.join(self.root, "images", img)).convert("L")
        im = im.resize((max(16, round(im.width * self.height / im.height)), self.height), Image.BILINEAR)
        return TF.to_tensor(im), torch.tensor(ids)


def collate(batch):
    xs, ys = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    out = torch.ones(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        out[i, ..., : x.shape[-1]] = x
    return out, nn.utils.rnn.pad_sequence(ys, batch_first=True)


class DecoderBlock(nn.Module):
    def __init__(self, d, heads=8):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

    def forward(self, x, mem, causal, pad_mask):
        h = self.n1(x)
        x = x + self.self_attn(h, h, h, attn_mask=causal, key_padding_mask=pad_mask, need_weights=False)[0]
        h = self.n2(x)
        x = x + self.cross_attn(h, mem, mem, need_weights=False)[0]
        return x + self.ff(self.n3(x))


class BigFormulaOCR(nn.Module):
    def __init__(self, vocab, d, layers, max_len, grad_ckpt):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, 64, 3, 2, 1), nn.GELU(), nn.Conv2d(64, 128, 3, 2, 1), nn.GELU(),
            nn.Conv2d(128, 256, 3, 2, 1), nn.GELU(), nn.Conv2d(256, d, 3, 2, 1))
        self.enc_norm = nn.LayerNorm(d)
        self.col_pos = nn.Parameter(torch.zeros(1, 1, 1024, d))
        self.row_pos = nn.Parameter(torch.zeros(1, 16, 1, d))
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        self.blocks = nn.ModuleList(DecoderBlock(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.grad_ckpt = grad_ckpt
        for p in (self.col_pos, self.row_pos, self.pos):
            nn.init.normal_(p, std=0.02)

    def forward(self, img, ys):
        f = self.stem(img).permute(0, 2, 3, 1)               # B, H/16, W/16, d
        H, W = f.shape[1:3]
        mem = self.enc_norm((f + self.row_pos[:, :H] + self.col_pos[:, :, :W]).flatten(1, 2))
        L = ys.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=ys.device).triu(1)
        x = self.emb(ys) + self.pos[:, :L]
        pad = ys.eq(0)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, mem, causal, pad, use_reentrant=False)
            else:
                x = blk(x, mem, causal, pad)
        return self.head(self.norm(x))


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    cache_file = os.path.join(args.root, f"labels_cache_len{args.max_len}.pt")
    if rank == 0 and not os.path.exists(cache_file):
        build_label_cache(args.root, args.max_len, cache_file)
    dist.barrier()
    cache = torch.load(cache_file)
    itos = cache["itos"]

    train_ds = FormulaSet(args.root, cache["train"], args.height)
    val_ds = FormulaSet(args.root, cache["val"], args.height)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.micro_bs, sampler=sampler, collate_fn=collate, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.micro_bs, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=4)

    model = BigFormulaOCR(len(itos), args.d, args.layers, args.max_len, args.grad_ckpt).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    updates_per_epoch = len(train_dl) // args.accum
    total = args.epochs * updates_per_epoch
    warm = min(2000, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    writer = SummaryWriter(args.run_dir) if rank == 0 else None

    upd = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (img, ys) in enumerate(train_dl):
            if i >= updates_per_epoch * args.accum:
                break                                   # identical on every rank: len(train_dl) is the same
            img, ys = img.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if last_micro:
                    logits = model(img, ys[:, :-1])
                    loss = F.cross_entropy(logits.float().transpose(1, 2), ys[:, 1:], ignore_index=0)
                    (loss / args.accum).backward()
                else:
                    with model.no_sync():
                        logits = model(img, ys[:, :-1])
                        loss = F.cross_entropy(logits.float().transpose(1, 2), ys[:, 1:], ignore_index=0)
                        (loss / args.accum).backward()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                upd += 1
                if writer and upd % 20 == 0:
                    writer.add_scalar("loss/train", loss.item(), upd)
                    writer.add_scalar("lr", sched.get_last_lr()[0], upd)

        model.eval()
        agg = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for img, ys in val_dl:
                img, ys = img.to(device), ys.to(device)
                logits = model(img, ys[:, :-1])
                agg[0] += F.cross_entropy(logits.float().transpose(1, 2), ys[:, 1:], ignore_index=0,
                                          reduction="sum").double()
                agg[1] += ys[:, 1:].ne(0).sum()
        dist.all_reduce(agg)
        val_nll = (agg[0] / agg[1]).item()
        if rank == 0:
            writer.add_scalar("loss/val", val_nll, epoch)
            print(f"epoch {epoch} val nll {val_nll:.4f} ppl {math.exp(val_nll):.3f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                        "itos": itos}, os.path.join(args.run_dir, "last.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
