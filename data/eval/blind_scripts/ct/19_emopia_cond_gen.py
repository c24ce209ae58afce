"""Emotion-conditioned piano generation: fine-tune a REMI Music Transformer (pre-trained on Pop1K7) on EMOPIA,
with the emotion quadrant (Q1..Q4) as a prefix token.

torchrun --nproc_per_node=4 19_emopia_cond_gen.py --emopia data/EMOPIA_1.0 --pretrained ckpt/pop1k7_remi.pt
"""
import argparse
import math
import os
import random
from pathlib import Path

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

QUADRANTS = ["Q1", "Q2", "Q3", "Q4"]


def is_main_process():
    return dist.get_rank() == 0


class EmopiaClips(Dataset):
    def __init__(self, clips, seq_len, emo_base, pitch_lo, pitch_hi, transpose=0):
        self.clips, self.seq_len, self.emo_base = clips, seq_len, emo_base
        self.lo, self.hi, self.transpose = pitch_lo, pitch_hi, transpose
        # clips are short (~30 s); long ones are cut into windows, each keeps the emotion prefix
        self.index = [(i, s) for i, (ids, _) in enumerate(clips) for s in range(0, max(1, len(ids) - seq_len + 1), seq_len - 1)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        ids, q = self.clips[i]
        w = ids[s:s + self.seq_len].astype(np.int64)
        if self.transpose:
            m = (w >= self.lo) & (w <= self.hi)
            if m.any():
                t = random.randint(-self.transpose, self.transpose)
                if w[m].min() + t >= self.lo and w[m].max() + t <= self.hi:
                    w[m] += t
        x = np.zeros(self.seq_len + 1, dtype=np.int64)
        x[0] = self.emo_base + q
        x[1:1 + len(w)] = w
        return torch.from_numpy(x)


class RelativeAttention(nn.Module):
    def __init__(self, d, h, max_len, p):
        super().__init__()
        self.h, self.dh, self.max_len = h, d // h, max_len
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.Er = nn.Parameter(torch.randn(max_len, d // h) * 0.02)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        srel = F.pad(q @ self.Er[-l:].T, (1, 0)).reshape(b, self.h, l + 1, l)[:, :, 1:]
        att = (q @ k.transpose(-1, -2) + srel) * self.dh ** -0.5
        att = att.masked_fill(torch.ones(l, l, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.proj((self.drop(att.softmax(-1)) @ v).transpose(1, 2).reshape(b, l, d))


class MusicTransformer(nn.Module):
    def __init__(self, vocab, d=512, n_layers=8, h=8, max_len=1024, p=0.1):
        super().__init__()
        self.max_len = max_len
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.ModuleList(RelativeAttention(d, h, max_len, p) for _ in range(n_layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p), nn.Linear(4 * d, d))
                                 for _ in range(n_layers))
        self.n1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layers))
        self.n2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layers))
        self.nf = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for a, m, n1, n2 in zip(self.attn, self.mlp, self.n1, self.n2):
            h = h + a(n1(h))
            h = h + m(n2(h))
        return self.out(self.nf(h))


@torch.no_grad()
def evaluate(net, loader, device, pitch_lo, pitch_hi):
    net.eval()
    t = torch.zeros(4, device=device, dtype=torch.float64)
    for x in loader:
        x = x.to(device)
        y = x[:, 2:]                                   # do not score the emotion prefix
        lg = net(x[:, :-1])[:, 1:].float()
        t[0] += F.cross_entropy(lg.transpose(1, 2), y, ignore_index=0, reduction="sum")
        t[1] += (y != 0).sum()
        pm = (y >= pitch_lo) & (y <= pitch_hi)
        t[2] += ((lg.argmax(-1) == y) & pm).sum()
        t[3] += pm.sum()
    dist.all_reduce(t)
    net.train()
    return math.exp(t[0] / t[1]), (t[2] / t[3]).item()


@torch.no_grad()
def generate(net, emo_token, n, device, top_k=30, temperature=1.0):
    seq = torch.tensor([[emo_token]], device=device)
    for _ in range(n):
        lg = net(seq[:, -net.max_len:])[:, -1] / temperature
        v, i = lg.topk(top_k)
        seq = torch.cat([seq, i.gather(1, torch.multinomial(v.softmax(-1), 1))], 1)
    return seq[0, 1:].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emopia", default="data/EMOPIA_1.0")
    ap.add_argument("--pretrained", default="")
    ap.add_argument("--out", default="runs/emopia_ft")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = REMI(TokenizerConfig(use_chords=True, use_tempos=True, num_velocities=32, special_tokens=["PAD", "BOS", "EOS"]))
    emo_base = len(tok.vocab)                          # emotion tokens appended after the REMI vocabulary
    pitch = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    split = pd.read_csv(Path(args.emopia) / "split" / "train_clip.csv"), pd.read_csv(Path(args.emopia) / "split" / "val_clip.csv")

    def load(df):
        clips = []
        for name in sorted(df["clip_name"]):
            seq = tok.encode(Score(str(Path(args.emopia) / "midis" / f"{name}.mid")))
            seq = seq[0] if isinstance(seq, list) else seq
            clips.append((np.asarray(seq.ids + [tok["EOS_None"]], dtype=np.int32), QUADRANTS.index(name[:2])))
        return clips

    train_ds = EmopiaClips(load(split[0]), args.seq_len, emo_base, pitch[0], pitch[-1], transpose=5)
    val_ds = EmopiaClips(load(split[1]), args.seq_len, emo_base, pitch[0], pitch[-1])
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=4, drop_last=True,
                          pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, range(dist.get_rank(), len(val_ds), world)), args.batch_size, num_workers=2)

    model = MusicTransformer(emo_base + len(QUADRANTS), max_len=args.seq_len)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")["model"]
        # grow the embedding / output layer for the 4 emotion tokens
        for k in ("emb.weight", "out.weight", "out.bias"):
            old = sd[k]
            new = model.state_dict()[k].clone()
            new[: old.shape[0]] = old
            sd[k] = new
        model.load_state_dict(sd)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.batch_size / 16, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    if is_main_process():
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x in train_dl:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lg = model(x[:, :-1])
            loss = F.cross_entropy(lg[:, 1:].float().transpose(1, 2), x[:, 2:], ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        if is_main_process() and (epoch + 1) % args.eval_every == 0:
            ppl, pacc = evaluate(model.module, val_dl, device, pitch[0], pitch[-1])
            print(f"epoch {epoch} loss {loss.item():.4f} val ppl {ppl:.3f} pitch acc {pacc:.4f}", flush=True)
            if ppl < best:
                best = ppl
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
            net = model.module.eval()
            for q in range(4):
                ids = generate(net, emo_base + q, 768, device)
                tok.decode([[i for i in ids if i < emo_base]]).dump_midi(
                    os.path.join(args.out, f"ep{epoch:03d}_{QUADRANTS[q]}.mid"))
            net.train()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
