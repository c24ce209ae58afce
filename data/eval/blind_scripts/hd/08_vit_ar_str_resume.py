"""
Autoregressive scene text recognizer (ViT-S encoder + 1-layer transformer decoder, PARSeq-like
AR mode) trained on the Union14M-L / real-label LMDBs. Long runs are preempted regularly, so the
script resumes from --resume.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        08_vit_ar_str_resume.py --train /shared/str/union14m_train --val /shared/str/union14m_val \
        --out /shared/str/runs/vit_ar --resume /shared/str/runs/vit_ar/last.ckpt
"""
import argparse
import io
import math
import os
import time

import lmdb
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms as T

CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
EOS, BOS, PAD = 0, len(CHARS) + 1, len(CHARS) + 2


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default="")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--max-steps", type=int, default=250_000)
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--max-len", type=int, default=25)
    ap.add_argument("--val-every", type=int, default=5000)
    ap.add_argument("--save-every", type=int, default=2000)
    return ap.parse_args()


class Lmdb(Dataset):
    def __init__(self, root, max_len, train):
        self.root, self.max_len = root, max_len
        env = lmdb.open(root, readonly=True, lock=False)
        with env.begin() as txn:
            self.n = int(txn.get(b"num-samples"))
        env.close()
        self.env = None
        self.tf = T.Compose([
            T.Resize((32, 128), T.InterpolationMode.BICUBIC),
            *([T.RandAugment(3, 5)] if train else []),
            T.ToTensor(), T.Normalize(0.5, 0.5),
        ])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.root, readonly=True, lock=False, readahead=False, max_readers=64)
        with self.env.begin() as txn:
            label = txn.get(b"label-%09d" % (i + 1)).decode()
            img = Image.open(io.BytesIO(txn.get(b"image-%09d" % (i + 1)))).convert("RGB")
        label = "".join(c for c in label if c in CHARS)[: self.max_len]
        return self.tf(img), label


def encode(labels, max_len, device):
    tgt = torch.full((len(labels), max_len + 2), PAD, dtype=torch.long)
    for i, s in enumerate(labels):
        ids = [BOS] + [CHARS.index(c) + 1 for c in s] + [EOS]
        tgt[i, : len(ids)] = torch.tensor(ids)
    return tgt.to(device, non_blocking=True)


class ARRecognizer(nn.Module):
    def __init__(self, max_len, d=384):
        super().__init__()
        self.encoder = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=(32, 128),
                                         patch_size=(4, 8), num_classes=0, global_pool="")
        self.embed = nn.Embedding(len(CHARS) + 3, d)
        self.pos = nn.Parameter(torch.zeros(1, max_len + 2, d))
        layer = nn.TransformerDecoderLayer(d, 12, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, 1)
        self.head = nn.Linear(d, len(CHARS) + 1)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, img, tgt_in):
        mem = self.encoder(img)
        L = tgt_in.size(1)
        causal = torch.triu(torch.full((L, L), float("-inf"), device=img.device), 1)
        x = self.embed(tgt_in) + self.pos[:, :L]
        return self.head(self.decoder(x, mem, tgt_mask=causal, tgt_key_padding_mask=tgt_in == PAD))

    @torch.no_grad()
    def greedy(self, img, max_len):
        mem = self.encoder(img)
        ys = torch.full((img.size(0), 1), BOS, dtype=torch.long, device=img.device)
        done = torch.zeros(img.size(0), dtype=torch.bool, device=img.device)
        for _ in range(max_len + 1):
            L = ys.size(1)
            causal = torch.triu(torch.full((L, L), float("-inf"), device=img.device), 1)
            h = self.decoder(self.embed(ys) + self.pos[:, :L], mem, tgt_mask=causal)
            nxt = self.head(h[:, -1]).argmax(-1)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt == EOS
            if done.all():
                break
        out = []
        for row in ys[:, 1:].tolist():
            s = []
            for k in row:
                if k == EOS:
                    break
                s.append(CHARS[k - 1] if 0 < k <= len(CHARS) else "")
            out.append("".join(s))
        return out


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * step / args.warmup
    p = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return 0.5 * args.lr * (1 + math.cos(math.pi * p))


@torch.no_grad()
def validate(net, loader, device, max_len):
    net.eval()
    c = torch.zeros(2, device=device)
    for img, labels in loader:
        preds = net.greedy(img.to(device), max_len)
        c[0] += sum(p == l for p, l in zip(preds, labels))
        c[1] += len(labels)
    dist.all_reduce(c)
    net.train()
    return (c[0] / c[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = ARRecognizer(args.max_len).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    step = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)
    model = DDP(model, device_ids=[local_rank])

    train_ds = Lmdb(args.train, args.max_len, train=True)
    val_ds = Lmdb(args.val, args.max_len, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=17)
    loader = DataLoader(train_ds, args.batch, sampler=sampler, num_workers=10, pin_memory=True, drop_last=True,
                        persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 256, num_workers=4)

    os.makedirs(args.out, exist_ok=True)
    epoch = step // len(loader)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for img, labels in loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            img = img.to(device, non_blocking=True)
            tgt = encode(labels, args.max_len, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img, tgt[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1),
                                   ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 20.0)
            opt.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {lr_at(step, args):.2e} "
                      f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()
            if step % args.save_every == 0 and rank == 0:
                tmp = os.path.join(args.out, "last.ckpt.tmp")
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, os.path.join(args.out, "last.ckpt"))
            if step % args.val_every == 0:
                acc = validate(model.module, val_loader, device, args.max_len)
                if rank == 0:
                    print(f"step {step} val acc {acc:.4f}", flush=True)
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
