#!/usr/bin/env python
"""Music Transformer (relative global attention, Huang et al. 2018) on REMI tokens of MAESTRO.

    torchrun --nproc_per_node=8 01_remi_music_transformer.py \
        --maestro_dir data/maestro-v3.0.0 --out_dir runs/mt_remi
"""
import argparse
import math
import os
import pickle
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from miditok import REMI, TokenizerConfig
from symusic import Score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

PITCH_LO, PITCH_HI = 21, 109


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--maestro_dir", required=True)
    p.add_argument("--out_dir", default="runs/mt_remi")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--n_layers", type=int, default=6)
    p.add_argument("--n_heads", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch_size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="lr for a global batch of 64")
    p.add_argument("--warmup_steps", type=int, default=4000)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--max_transpose", type=int, default=5)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--sample_every", type=int, default=5)
    p.add_argument("--resume", default="")
    return p.parse_args()


def build_tokenizer():
    cfg = TokenizerConfig(
        pitch_range=(PITCH_LO, PITCH_HI),
        beat_res={(0, 4): 8, (4, 12): 4},
        num_velocities=32,
        special_tokens=["PAD", "BOS", "EOS"],
        use_tempos=True,
        num_tempos=32,
        tempo_range=(40, 250),
    )
    return REMI(cfg)


def tokenize_split(tokenizer, root, files):
    out = []
    for f in files:
        seq = tokenizer.encode(Score(os.path.join(root, f)))
        if isinstance(seq, list):
            seq = seq[0]
        ids = [tokenizer["BOS_None"]] + list(seq.ids) + [tokenizer["EOS_None"]]
        out.append(np.asarray(ids, dtype=np.int32))
    return out


class PitchShifter:
    def __init__(self, tokenizer):
        n = len(tokenizer.vocab)
        self.pitch_of = np.full(n, -1, dtype=np.int32)
        self.id_of = np.full(128, -1, dtype=np.int32)
        for tok, i in tokenizer.vocab.items():
            if tok.startswith("Pitch_"):
                pitch = int(tok.split("_")[1])
                self.pitch_of[i] = pitch
                self.id_of[pitch] = i

    def __call__(self, ids, shift):
        if shift == 0:
            return ids
        mask = self.pitch_of[ids] >= 0
        if not mask.any():
            return ids
        pitches = self.pitch_of[ids[mask]] + shift
        if pitches.min() < PITCH_LO or pitches.max() >= PITCH_HI:
            return ids
        ids = ids.copy()
        ids[mask] = self.id_of[pitches]
        return ids


class WindowDataset(Dataset):
    """Cuts pieces of very different lengths into fixed windows of seq_len + 1 tokens."""

    def __init__(self, pieces, seq_len, stride, pad_id, shifter=None, max_transpose=0):
        self.pieces, self.seq_len, self.pad_id = pieces, seq_len, pad_id
        self.shifter, self.max_transpose = shifter, max_transpose
        self.index = []
        for pi, toks in enumerate(pieces):
            last = max(len(toks) - seq_len - 1, 0)
            for start in range(0, last + 1, stride):
                self.index.append((pi, start))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        pi, start = self.index[i]
        chunk = self.pieces[pi][start:start + self.seq_len + 1]
        if self.shifter is not None and self.max_transpose > 0:
            chunk = self.shifter(chunk, np.random.randint(-self.max_transpose, self.max_transpose + 1))
        x = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        x[:len(chunk)] = chunk
        x = torch.from_numpy(x)
        return x[:-1], x[1:]


class RelativeGlobalAttention(nn.Module):
    def __init__(self, d_model, n_heads, max_len, dropout):
        super().__init__()
        self.h, self.dh, self.max_len = n_heads, d_model // n_heads, max_len
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.Er = nn.Parameter(torch.randn(max_len, self.dh) * 0.02)
        self.drop = nn.Dropout(dropout)

    @staticmethod
    def skew(qe):
        b, h, l, _ = qe.shape
        qe = F.pad(qe, (1, 0)).reshape(b, h, l + 1, l)
        return qe[:, :, 1:, :]

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = (t.view(b, l, self.h, self.dh).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))
        srel = self.skew(q @ self.Er[self.max_len - l:].t())
        att = (q @ k.transpose(-2, -1) + srel) / math.sqrt(self.dh)
        causal = torch.ones(l, l, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(causal, float("-inf")).softmax(-1))
        return self.out((att @ v).transpose(1, 2).reshape(b, l, d))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, max_len, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = RelativeGlobalAttention(d_model, n_heads, max_len, dropout)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class MusicTransformer(nn.Module):
    def __init__(self, vocab_size, d_model, n_layers, n_heads, max_len, dropout):
        super().__init__()
        self.max_len = max_len
        self.emb = nn.Embedding(vocab_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d_model, n_heads, max_len, dropout) for _ in range(n_layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.scale = math.sqrt(d_model)

    def forward(self, x):
        h = self.drop(self.emb(x) * self.scale)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))

    @torch.no_grad()
    def generate(self, prime, n_tokens, temperature=1.0, top_k=32, eos_id=None):
        seq = prime
        for _ in range(n_tokens):
            logits = self(seq[:, -self.max_len:])[:, -1] / temperature
            v, _ = torch.topk(logits, top_k)
            logits[logits < v[:, [-1]]] = float("-inf")
            nxt = torch.multinomial(logits.softmax(-1), 1)
            seq = torch.cat([seq, nxt], dim=1)
            if eos_id is not None and nxt.item() == eos_id:
                break
        return seq


@torch.no_grad()
def evaluate(net, loader, device, pad_id, pitch_of):
    net.eval()
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # nll, tokens, pitch hits, pitch count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x)
        nll = F.cross_entropy(logits.float().transpose(1, 2), y, ignore_index=pad_id, reduction="sum")
        valid = y != pad_id
        is_pitch = pitch_of[y] >= 0
        stats += torch.stack([
            nll.double(),
            valid.sum().double(),
            ((logits.argmax(-1) == y) & is_pitch).sum().double(),
            is_pitch.sum().double(),
        ])
    dist.all_reduce(stats)
    net.train()
    return math.exp(stats[0] / stats[1]), (stats[2] / stats[3].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tokenizer = build_tokenizer()
    pad_id = tokenizer["PAD_None"]
    meta = pd.read_csv(os.path.join(args.maestro_dir, "maestro-v3.0.0.csv"))
    cache = os.path.join(args.out_dir, "tokens.pkl")
    if rank == 0:
        os.makedirs(os.path.join(args.out_dir, "samples"), exist_ok=True)
        if not os.path.exists(cache):
            splits = {s: tokenize_split(tokenizer, args.maestro_dir, sorted(meta[meta.split == s].midi_filename))
                      for s in ("train", "validation")}
            with open(cache + ".tmp", "wb") as f:
                pickle.dump(splits, f)
            os.replace(cache + ".tmp", cache)
    dist.barrier()
    with open(cache, "rb") as f:
        splits = pickle.load(f)

    shifter = PitchShifter(tokenizer)
    train_set = WindowDataset(splits["train"], args.seq_len, args.stride, pad_id, shifter, args.max_transpose)
    val_set = WindowDataset(splits["validation"], args.seq_len, args.seq_len, pad_id)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, num_workers=2, pin_memory=True)

    model = MusicTransformer(len(tokenizer.vocab), args.d_model, args.n_layers, args.n_heads,
                             args.seq_len, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    raw = model.module
    lr = args.lr * args.batch_size * world_size / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    total_steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps)
        * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))

    start_epoch, best_ppl = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        raw.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_ppl = ckpt["epoch"] + 1, ckpt["best_ppl"]

    writer = SummaryWriter(args.out_dir) if rank == 0 else None
    pitch_of = torch.from_numpy(shifter.pitch_of).to(device)
    step = start_epoch * len(train_loader)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float().transpose(1, 2), y, ignore_index=pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        ppl, pitch_acc = evaluate(raw, val_loader, device, pad_id, pitch_of)
        if rank == 0:
            print(f"epoch {epoch} ppl {ppl:.3f} pitch_acc {pitch_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("val/ppl", ppl, epoch)
            writer.add_scalar("val/pitch_acc", pitch_acc, epoch)
            state = {"model": raw.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best_ppl": min(best_ppl, ppl)}
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if ppl < best_ppl:
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
            if epoch % args.sample_every == 0:
                raw.eval()
                prime = torch.tensor([[tokenizer["BOS_None"]]], device=device)
                out = raw.generate(prime, 1024, temperature=1.0, eos_id=tokenizer["EOS_None"])
                raw.train()
                tokenizer.decode([out[0, 1:].tolist()]).dump_midi(
                    os.path.join(args.out_dir, "samples", f"epoch{epoch:03d}.mid"))
        best_ppl = min(best_ppl, ppl)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
