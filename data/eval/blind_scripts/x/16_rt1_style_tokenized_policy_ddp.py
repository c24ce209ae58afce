"""
RT-1 style policy: FiLM-conditioned image tokens + TokenLearner + transformer, 256-bin discretised
actions, word-level instruction embedding. Data: one HDF5 file per episode (images, actions,
instruction), converted from RLDS.

    torchrun --nproc_per_node=8 train_rt1.py --episodes_dir /data/fractal_h5 --out ckpts/rt1_small
"""
import argparse
import glob
import os
import re
from collections import Counter

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, RandomSampler

import wandb

N_BINS = 256


def tokenize(text):
    return re.findall(r"[a-z]+", text.lower())


def build_vocab(instructions, min_count=1):
    counts = Counter(w for s in instructions for w in tokenize(s))
    words = sorted(w for w, c in counts.items() if c >= min_count)
    return {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}


class EpisodeFiles(Dataset):
    def __init__(self, files, hist, vocab, max_words=16):
        self.files, self.hist, self.vocab, self.max_words = files, hist, vocab, max_words
        self.index = []
        for fi, f in enumerate(files):
            with h5py.File(f, "r") as h:
                self.index += [(fi, t) for t in range(h["actions"].shape[0])]

    def encode(self, text):
        ids = [self.vocab.get(w, 1) for w in tokenize(text)][: self.max_words]
        return torch.tensor(ids + [0] * (self.max_words - len(ids)))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        fi, t = self.index[i]
        with h5py.File(self.files[fi], "r") as h:
            ids = np.clip(np.arange(t - self.hist + 1, t + 1), 0, None)
            imgs = h["rgb"][()][ids]  # [hist, 256, 320, 3]
            act = h["actions"][t]  # already in [-1, 1]
            text = h.attrs["instruction"]
        img = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255.0
        bins = torch.from_numpy(np.clip(((act + 1) / 2 * (N_BINS - 1)).round(), 0, N_BINS - 1).astype(np.int64))
        return img, self.encode(text), bins


def read_instructions(files):
    out = []
    for f in files:
        with h5py.File(f, "r") as h:
            out.append(h.attrs["instruction"])
    return out


class FiLMResNet(nn.Module):
    def __init__(self, lang_dim):
        super().__init__()
        rn = torchvision.models.resnet18(weights=None, norm_layer=lambda c: nn.GroupNorm(16, c))
        self.stem = nn.Sequential(rn.conv1, rn.bn1, rn.relu, rn.maxpool)
        self.layers = nn.ModuleList([rn.layer1, rn.layer2, rn.layer3, rn.layer4])
        self.films = nn.ModuleList([nn.Linear(lang_dim, 2 * c) for c in (64, 128, 256, 512)])

    def forward(self, x, lang):
        x = self.stem(x)
        for layer, film in zip(self.layers, self.films):
            x = layer(x)
            g, b = film(lang)[..., None, None].chunk(2, 1)
            x = x * (1 + g) + b
        return x  # [B, 512, h, w]


class TokenLearner(nn.Module):
    def __init__(self, dim, n_tokens=8):
        super().__init__()
        self.attn = nn.Sequential(nn.Conv2d(dim, dim, 1), nn.GELU(), nn.Conv2d(dim, n_tokens, 1))

    def forward(self, x):
        w = self.attn(x).flatten(2).softmax(-1)  # [B, n, hw]
        return torch.einsum("bnl,bdl->bnd", w, x.flatten(2))


class RT1(nn.Module):
    def __init__(self, vocab_size, hist, action_dim=7, dim=512, lang_dim=256):
        super().__init__()
        self.word_emb = nn.EmbeddingBag(vocab_size, lang_dim, mode="mean", padding_idx=0)
        self.vision = FiLMResNet(lang_dim)
        self.tl = TokenLearner(512)
        self.pos = nn.Parameter(torch.zeros(1, hist * 8, dim))
        self.tf = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 8, 2048, 0.1, batch_first=True,
                                                                   norm_first=True), 8)
        self.action_queries = nn.Parameter(torch.randn(1, action_dim, dim) * 0.02)
        self.head = nn.Linear(dim, N_BINS)

    def forward(self, img, words):
        B, T = img.shape[:2]
        lang = self.word_emb(words)
        feat = self.vision(img.flatten(0, 1), lang.repeat_interleave(T, 0))
        tok = self.tl(feat).view(B, T * 8, -1) + self.pos
        h = self.tf(torch.cat([tok, self.action_queries.expand(B, -1, -1)], 1))
        return self.head(h[:, -self.action_queries.shape[1]:])  # [B, action_dim, N_BINS]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes_dir", required=True)
    ap.add_argument("--out", default="ckpts/rt1")
    ap.add_argument("--hist", type=int, default=6)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=150_000)
    ap.add_argument("--steps_per_eval", type=int, default=5000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.episodes_dir, "*.h5")))
    val_files, train_files = files[:200], files[200:]
    # every rank opens only its own slice of episode files; sampling with replacement and a fixed
    # number of samples keeps the step count identical on all ranks
    my_files = train_files[rank::world]
    vocab = build_vocab(read_instructions(my_files))
    train_ds = EpisodeFiles(my_files, args.hist, vocab)
    val_ds = EpisodeFiles(val_files[rank::world], args.hist, vocab)
    n_per_rank = args.steps_per_eval * args.bs
    train_dl = DataLoader(train_ds, batch_size=args.bs, num_workers=10, pin_memory=True, drop_last=True,
                          sampler=RandomSampler(train_ds, replacement=True, num_samples=n_per_rank),
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, num_workers=4,
                        sampler=RandomSampler(val_ds, replacement=True, num_samples=50 * args.bs))

    model = RT1(len(vocab), args.hist).to(device)
    model = DDP(model, device_ids=[local_rank])
    torch.manual_seed(1000 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.02)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="rt1-fractal", config={**vars(args), "vocab_size": len(vocab)})

    step = 0
    while step < args.steps:
        model.train()
        for img, words, bins in train_dl:
            img, words, bins = img.to(device, non_blocking=True), words.to(device), bins.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img, words)
            loss = F.cross_entropy(logits.float().flatten(0, 1), bins.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/ce": l.item(), "lr": sched.get_last_lr()[0]}, step=step)
            if step >= args.steps:
                break

        model.eval()
        acc = torch.zeros(3, device=device)
        with torch.no_grad():
            for img, words, bins in val_dl:
                img, words, bins = img.to(device), words.to(device), bins.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(img, words).float()
                acc += torch.stack([F.cross_entropy(logits.flatten(0, 1), bins.flatten(), reduction="sum"),
                                    (logits.argmax(-1) == bins).sum().float(),
                                    torch.tensor(float(bins.numel()), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            wandb.log({"val/ce": (acc[0] / acc[2]).item(), "val/bin_acc": (acc[1] / acc[2]).item()}, step=step)
            torch.save({"model": model.module.state_dict(), "vocab": vocab, "step": step},
                       os.path.join(args.out, f"rt1_{step:07d}.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
