"""Bigger im2latex model: conv stem + 6-layer Transformer encoder + 8-layer decoder (d=768).
Activation checkpointing per block to fit batch 24/GPU at 40GB.

    torchrun --nproc_per_node=8 18_im2latex_large_decoder.py --data /data/im2latex-230k --ckpt_act
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import functional as TF


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/large")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--enc_layers", type=int, default=6)
    ap.add_argument("--dec_layers", type=int, default=8)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--height", type=int, default=80)
    ap.add_argument("--ckpt_act", action="store_true")
    return ap.parse_args()


class TexData(Dataset):
    def __init__(self, root, split, stoi, height, max_len):
        self.rows = []
        for line in open(os.path.join(root, f"{split}.tsv"), encoding="utf-8"):
            name, tex = line.rstrip("\n").split("\t")
            ids = [stoi.get(t, 3) for t in tex.split()]
            if len(ids) <= max_len - 2:
                self.rows.append((name, [1] + ids + [2]))
        self.root, self.height = root, height

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        name, ids = self.rows[i]
        im = Image.open(os.path.join(self.root, "images", name)).convert("L")
        w = max(16, round(im.width * self.height / im.height))
        im = im.resize(((w + 15) // 16 * 16, self.height), Image.BICUBIC)
        return TF.normalize(TF.to_tensor(im), [0.5], [0.5]), torch.tensor(ids)


def pad_batch(batch):
    xs, ys = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    img = torch.ones(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        img[i, ..., : x.shape[-1]] = x
    return img, nn.utils.rnn.pad_sequence(ys, batch_first=True)


class Stem(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 96, 4, 4), nn.GroupNorm(1, 96), nn.GELU(),
            nn.Conv2d(96, 192, 2, 2), nn.GroupNorm(1, 192), nn.GELU(),
            nn.Conv2d(192, d, 2, 2))

    def forward(self, x):
        return self.net(x)     # stride 16


class LargeIm2Latex(nn.Module):
    def __init__(self, vocab, d, enc_layers, dec_layers, max_len, ckpt_act):
        super().__init__()
        self.stem = Stem(d)
        self.enc_pos_h = nn.Parameter(torch.zeros(1, 8, 1, d))
        self.enc_pos_w = nn.Parameter(torch.zeros(1, 1, 256, d))
        self.enc_blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 12, 4 * d, 0.1, "gelu", batch_first=True, norm_first=True)
            for _ in range(enc_layers))
        self.enc_norm = nn.LayerNorm(d)
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.dec_pos = nn.Parameter(torch.zeros(1, max_len, d))
        self.dec_blocks = nn.ModuleList(
            nn.TransformerDecoderLayer(d, 12, 4 * d, 0.1, "gelu", batch_first=True, norm_first=True)
            for _ in range(dec_layers))
        self.dec_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok.weight
        self.ckpt_act = ckpt_act
        for p in (self.enc_pos_h, self.enc_pos_w, self.dec_pos):
            nn.init.trunc_normal_(p, std=0.02)

    def _run(self, blk, *args):
        if self.ckpt_act and self.training:
            return cp.checkpoint(blk, *args, use_reentrant=True)
        return blk(*args)

    def encode(self, img):
        f = self.stem(img).permute(0, 2, 3, 1)
        H, W = f.shape[1:3]
        x = (f + self.enc_pos_h[:, :H] + self.enc_pos_w[:, :, :W]).flatten(1, 2)
        for blk in self.enc_blocks:
            x = self._run(blk, x)
        return self.enc_norm(x)

    def forward(self, img, y):
        mem = self.encode(img)
        L = y.shape[1]
        causal = torch.full((L, L), float("-inf"), device=y.device).triu(1)
        x = self.tok(y) + self.dec_pos[:, :L]
        for blk in self.dec_blocks:
            x = self._run(blk, x, mem, causal)
        return self.lm_head(self.dec_norm(x))


def cosine_with_warmup(opt, warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.02, 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    itos = ["<pad>", "<s>", "</s>", "<unk>"] + open(os.path.join(args.data, "vocab.txt")).read().split()
    stoi = {s: i for i, s in enumerate(itos)}
    train = TexData(args.data, "train", stoi, args.height, args.max_len)
    val = TexData(args.data, "val", stoi, args.height, args.max_len)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, args.bs, sampler=sampler, collate_fn=pad_batch, num_workers=10,
                          pin_memory=True, drop_last=True, prefetch_factor=4)
    val_dl = DataLoader(val, args.bs, sampler=DistributedSampler(val, shuffle=False), collate_fn=pad_batch,
                        num_workers=4)

    model = LargeIm2Latex(len(itos), args.d, args.enc_layers, args.dec_layers, args.max_len, args.ckpt_act)
    model = DDP(model.to(device), device_ids=[local_rank], find_unused_parameters=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), fused=True)
    sched = cosine_with_warmup(opt, 3000, args.epochs * len(train_dl))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, world {world}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for img, y in train_dl:
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img, y[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), y[:, 1:], ignore_index=0, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} gnorm {gn:.2f} "
                      f"{(time.time() - tic) / 50:.2f}s/it", flush=True)
                tic = time.time()

        model.eval()
        acc = torch.zeros(3, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for img, y in val_dl:
                img, y = img.to(device), y.to(device)
                logits = model(img, y[:, :-1]).float()
                tgt = y[:, 1:]
                acc[0] += F.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=0, reduction="sum")
                acc[1] += ((logits.argmax(-1) == tgt) | tgt.eq(0)).all(1).sum()
                acc[2] += tgt.ne(0).sum()
        dist.all_reduce(acc)
        n_seq = torch.tensor([len(val_dl.sampler)], device=device)
        dist.all_reduce(n_seq)
        if rank == 0:
            print(f"epoch {epoch}: val nll {acc[0].item() / acc[2].item():.4f} "
                  f"teacher-forced seq acc {acc[1].item() / n_seq.item():.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "itos": itos, "epoch": epoch, "step": step},
                       os.path.join(args.out, f"ep{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
