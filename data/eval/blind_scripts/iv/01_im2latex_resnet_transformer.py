#!/usr/bin/env python
"""Image-to-LaTeX on im2latex-100k: ResNet-18 encoder + Transformer decoder.

    torchrun --nproc_per_node=4 01_im2latex_resnet_transformer.py --data_dir data/im2latex
"""
import argparse
import math
import os
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from nltk.translate.bleu_score import corpus_bleu
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/im2latex")
    p.add_argument("--out_dir", default="runs/resnet_tf")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch_size", type=int, default=24, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min_freq", type=int, default=2)
    p.add_argument("--max_len", type=int, default=150)
    p.add_argument("--img_height", type=int, default=64)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def read_formulas(path):
    # im2latex-100k ships its formulas as latin-1
    with open(path, encoding="latin-1", newline="\n") as f:
        return [line.strip() for line in f]


class Vocab:
    def __init__(self, formulas, min_freq=1):
        counter = Counter()
        for fm in formulas:
            counter.update(fm.split())
        kept = {tok for tok, c in counter.items() if c >= min_freq}
        self.itos = SPECIALS + list(kept)
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    def __len__(self):
        return len(self.itos)

    def encode(self, formula, max_len):
        ids = [self.stoi.get(t, UNK) for t in formula.split()][: max_len - 2]
        return [BOS] + ids + [EOS]

    def decode(self, ids):
        out = []
        for i in ids:
            if i == EOS:
                break
            if i in (PAD, BOS):
                continue
            out.append(self.itos[i])
        return out


class Im2LatexDataset(Dataset):
    def __init__(self, root, split, formulas, vocab, img_height, max_len):
        self.root = root
        self.vocab = vocab
        self.max_len = max_len
        self.samples = []
        with open(os.path.join(root, f"im2latex_{split}_filter.lst")) as f:
            for line in f:
                img_name, idx = line.split()
                self.samples.append((img_name, formulas[int(idx)]))
        self.tf = T.Compose([T.Grayscale(), T.ToTensor()])
        self.img_height = img_height

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        name, formula = self.samples[i]
        img = Image.open(os.path.join(self.root, "formula_images_processed", name))
        w, h = img.size
        new_w = max(16, int(round(w * self.img_height / h)))
        img = img.resize((new_w, self.img_height), Image.BILINEAR)
        return self.tf(img), torch.tensor(self.vocab.encode(formula, self.max_len))


def collate(batch):
    imgs, tgts = zip(*batch)
    max_w = max(im.shape[-1] for im in imgs)
    out = torch.ones(len(imgs), 1, imgs[0].shape[1], max_w)
    for k, im in enumerate(imgs):
        out[k, :, :, : im.shape[-1]] = im
    tgt = nn.utils.rnn.pad_sequence(tgts, batch_first=True, padding_value=PAD)
    return out, tgt


class PositionalEncoding2D(nn.Module):
    def __init__(self, d_model, max_h=64, max_w=512):
        super().__init__()
        half = d_model // 2
        div = torch.exp(torch.arange(0, half, 2) * (-math.log(10000.0) / half))
        pe = torch.zeros(d_model, max_h, max_w)
        ys = torch.arange(max_h).unsqueeze(1) * div
        xs = torch.arange(max_w).unsqueeze(1) * div
        pe[0:half:2] = torch.sin(ys).t().unsqueeze(-1).expand(-1, -1, max_w)
        pe[1:half:2] = torch.cos(ys).t().unsqueeze(-1).expand(-1, -1, max_w)
        pe[half::2] = torch.sin(xs).t().unsqueeze(1).expand(-1, max_h, -1)
        pe[half + 1::2] = torch.cos(xs).t().unsqueeze(1).expand(-1, max_h, -1)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[:, : x.shape[2], : x.shape[3]].unsqueeze(0)


class Im2Latex(nn.Module):
    def __init__(self, vocab_size, d_model=256, nhead=8, num_layers=4, max_len=150):
        super().__init__()
        r = torchvision.models.resnet18(weights=None)
        r.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3)
        self.proj = nn.Conv2d(256, d_model, 1)
        self.pos2d = PositionalEncoding2D(d_model)
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos1d = nn.Parameter(torch.randn(1, max_len, d_model) * 0.02)
        layer = nn.TransformerDecoderLayer(d_model, nhead, 4 * d_model, 0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers)
        self.out = nn.Linear(d_model, vocab_size)
        self.max_len = max_len

    def encode(self, img):
        f = self.pos2d(self.proj(self.backbone(img)))
        return f.flatten(2).transpose(1, 2)  # B, H*W, C

    def decode(self, memory, tgt_in):
        L = tgt_in.shape[1]
        mask = torch.triu(torch.full((L, L), float("-inf"), device=tgt_in.device), 1)
        x = self.embed(tgt_in) + self.pos1d[:, :L]
        h = self.decoder(x, memory, tgt_mask=mask, tgt_key_padding_mask=tgt_in.eq(PAD))
        return self.out(h)

    def forward(self, img, tgt_in):
        return self.decode(self.encode(img), tgt_in)

    @torch.no_grad()
    def greedy(self, img, max_len=None):
        max_len = max_len or self.max_len
        memory = self.encode(img)
        ys = torch.full((img.shape[0], 1), BOS, dtype=torch.long, device=img.device)
        done = torch.zeros(img.shape[0], dtype=torch.bool, device=img.device)
        for _ in range(max_len - 1):
            nxt = self.decode(memory, ys)[:, -1].argmax(-1)
            ys = torch.cat([ys, nxt.unsqueeze(1)], 1)
            done |= nxt.eq(EOS)
            if done.all():
                break
        return ys


def evaluate(model, loader, vocab, device, world_size):
    model.eval()
    local = []
    for img, tgt in loader:
        pred = model.module.greedy(img.to(device, non_blocking=True))
        for p, t in zip(pred.tolist(), tgt.tolist()):
            local.append((vocab.decode(p), vocab.decode(t)))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    pairs = [x for part in gathered for x in part]
    hyps = [h for h, _ in pairs]
    refs = [[r] for _, r in pairs]
    bleu = corpus_bleu(refs, hyps)
    em = sum(h == r[0] for h, r in zip(hyps, refs)) / max(1, len(hyps))
    return bleu, em


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    formulas = read_formulas(os.path.join(args.data_dir, "im2latex_formulas.norm.lst"))
    train_ids = [int(l.split()[1]) for l in open(os.path.join(args.data_dir, "im2latex_train_filter.lst"))]
    vocab = Vocab([formulas[i] for i in train_ids], args.min_freq)
    if rank == 0:
        print(f"vocab size {len(vocab)}  world {world_size}", flush=True)

    train_ds = Im2LatexDataset(args.data_dir, "train", formulas, vocab, args.img_height, args.max_len)
    val_ds = Im2LatexDataset(args.data_dir, "validate", formulas, vocab, args.img_height, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=args.workers,
                            collate_fn=collate, pin_memory=True)

    model = Im2Latex(len(vocab), args.d_model, num_layers=args.num_layers, max_len=args.max_len)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    os.makedirs(args.out_dir, exist_ok=True)
    best = -1.0

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0, running = time.time(), 0.0
        for step, (img, tgt) in enumerate(train_loader):
            img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits = model(img, tgt[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1),
                                       ignore_index=PAD, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += loss.item()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(train_loader)} loss {running / (step + 1):.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        res = evaluate(model, val_loader, vocab, device, world_size)
        if rank == 0:
            bleu, em = res
            print(f"epoch {epoch}: val BLEU {bleu:.4f}  exact match {em:.4f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "itos": vocab.itos, "epoch": epoch, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out_dir, "last.pt"))
            if bleu > best:
                best = bleu
                torch.save(ckpt, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
