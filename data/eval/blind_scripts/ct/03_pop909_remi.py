"""REMI language model on POP909 (melody / bridge / piano tracks), vanilla transformer baseline.

torchrun --nproc_per_node=4 03_pop909_remi.py --pop909 data/POP909 --out runs/pop909_remi
"""
import argparse
import math
import os
import random

import numpy as np
import pretty_midi
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


class REMI:
    """Minimal REMI: Bar, Position (16th grid), Tempo, Track, Pitch, Velocity, Duration."""
    N_POS, N_TEMPO, N_VEL, N_DUR = 16, 32, 16, 32
    PITCHES = range(21, 109)
    TRACKS = ("MELODY", "BRIDGE", "PIANO")

    def __init__(self):
        toks = ["PAD", "BOS", "EOS", "Bar"]
        toks += [f"Pos_{i}" for i in range(self.N_POS)]
        toks += [f"Tempo_{i}" for i in range(self.N_TEMPO)]
        toks += [f"Track_{t}" for t in self.TRACKS]
        toks += [f"Pitch_{p}" for p in self.PITCHES]
        toks += [f"Vel_{i}" for i in range(self.N_VEL)]
        toks += [f"Dur_{i}" for i in range(1, self.N_DUR + 1)]
        self.itos = toks
        self.stoi = {t: i for i, t in enumerate(toks)}
        self.pad, self.bos, self.eos = 0, 1, 2
        self.pitch_base = self.stoi["Pitch_21"]

    def __len__(self):
        return len(self.itos)

    def encode(self, path):
        pm = pretty_midi.PrettyMIDI(path)
        beats = pm.get_beats()
        if len(beats) < 8:
            return None
        grid = np.interp(np.arange(0, len(beats) - 1, 0.25), np.arange(len(beats)), beats)
        events = []
        for inst in pm.instruments:
            if inst.name.upper() not in self.TRACKS:
                continue
            for n in inst.notes:
                on = int(np.argmin(np.abs(grid - n.start)))
                off = int(np.argmin(np.abs(grid - n.end)))
                dur = min(max(off - on, 1), self.N_DUR)
                events.append((on, self.TRACKS.index(inst.name.upper()), n.pitch, n.velocity, dur))
        events.sort()
        tempo = pm.estimate_tempo()
        tbin = int(np.clip((tempo - 40) / 200 * self.N_TEMPO, 0, self.N_TEMPO - 1))
        ids, cur_bar, cur_pos = [self.bos, self.stoi[f"Tempo_{tbin}"]], -1, -1
        for on, trk, pitch, vel, dur in events:
            if not 21 <= pitch <= 108:
                continue
            bar, pos = divmod(on, self.N_POS)
            while cur_bar < bar:
                ids.append(self.stoi["Bar"])
                cur_bar, cur_pos = cur_bar + 1, -1
            if pos != cur_pos:
                ids.append(self.stoi[f"Pos_{pos}"])
                cur_pos = pos
            ids += [self.stoi[f"Track_{self.TRACKS[trk]}"], self.stoi[f"Pitch_{pitch}"],
                    self.stoi[f"Vel_{vel * self.N_VEL // 128}"], self.stoi[f"Dur_{dur}"]]
        ids.append(self.eos)
        return np.asarray(ids, dtype=np.int16)

    def decode(self, ids, bpm=100.0):
        pm = pretty_midi.PrettyMIDI(initial_tempo=bpm)
        insts = {t: pretty_midi.Instrument(0, name=t) for t in self.TRACKS}
        step = 60.0 / bpm / 4
        bar, pos, trk, pitch, vel = -1, 0, "PIANO", None, 80
        for i in ids:
            t = self.itos[i]
            if t == "Bar":
                bar += 1
            elif t.startswith("Pos_"):
                pos = int(t[4:])
            elif t.startswith("Track_"):
                trk = t[6:]
            elif t.startswith("Pitch_"):
                pitch = int(t[6:])
            elif t.startswith("Vel_"):
                vel = int(t[4:]) * 128 // self.N_VEL + 4
            elif t.startswith("Dur_") and pitch is not None:
                start = (max(bar, 0) * self.N_POS + pos) * step
                insts[trk].notes.append(pretty_midi.Note(vel, pitch, start, start + int(t[4:]) * step))
                pitch = None
        pm.instruments.extend(insts.values())
        return pm


def load_corpus(root, cache_dir, tok):
    songs = sorted(d for d in os.listdir(root) if d.isdigit())
    os.makedirs(cache_dir, exist_ok=True)
    out = {}
    for song in tqdm(songs, disable=int(os.environ.get("RANK", 0)) != 0):
        npy = os.path.join(cache_dir, f"{song}.npy")
        if not os.path.exists(npy):
            ids = tok.encode(os.path.join(root, song, f"{song}.mid"))
            if ids is None:
                continue
            np.save(npy, ids)
        out[song] = np.load(npy)
    return out


class Windows(Dataset):
    def __init__(self, pieces, seq_len, pitch_base, n_pitch, transpose=0):
        self.pieces, self.seq_len, self.transpose = pieces, seq_len, transpose
        self.pitch_base, self.n_pitch = pitch_base, n_pitch
        self.index = [(k, s) for k, p in enumerate(pieces) for s in range(0, max(1, len(p) - seq_len), seq_len // 2)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        k, s = self.index[i]
        w = self.pieces[k][s:s + self.seq_len + 1].astype(np.int64)
        if self.transpose:
            is_p = (w >= self.pitch_base) & (w < self.pitch_base + self.n_pitch)
            if is_p.any():
                lo, hi = w[is_p].min() - self.pitch_base, w[is_p].max() - self.pitch_base
                shift = random.randint(max(-self.transpose, -lo), min(self.transpose, self.n_pitch - 1 - hi))
                w[is_p] += shift
        x = np.zeros(self.seq_len + 1, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x[:-1]), torch.from_numpy(x[1:])


class REMILM(nn.Module):
    def __init__(self, vocab, d=512, layers=8, heads=8, max_len=1024, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, activation="gelu", batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(enc, layers)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.max_len = max_len

    def forward(self, x):
        l = x.size(1)
        h = self.tok(x) + self.pos(torch.arange(l, device=x.device))
        mask = torch.triu(torch.full((l, l), float("-inf"), device=x.device), 1)
        return self.head(self.ln(self.body(h, mask=mask)))


@torch.no_grad()
def sample(net, tok, device, n=1024, top_k=20, temp=1.0):
    seq = torch.tensor([[tok.bos]], device=device)
    for _ in range(n):
        logits = net(seq[:, -net.max_len:])[0, -1] / temp
        v, i = logits.topk(top_k)
        nxt = i[torch.multinomial(v.softmax(-1), 1)]
        seq = torch.cat([seq, nxt.view(1, 1)], 1)
        if nxt.item() == tok.eos:
            break
    return seq[0].tolist()


@torch.no_grad()
def validate(net, loader, device, tok):
    net.eval()
    s = torch.zeros(4, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = net(x)
        s[0] += F.cross_entropy(logits.float().transpose(1, 2), y, ignore_index=0, reduction="sum")
        s[1] += (y != 0).sum()
        note = (y >= tok.pitch_base) & (y < tok.pitch_base + len(tok.PITCHES))
        s[2] += ((logits.argmax(-1) == y) & note).sum()
        s[3] += note.sum()
    dist.all_reduce(s)
    net.train()
    return math.exp(s[0] / s[1]), (s[2] / s[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pop909", default="data/POP909")
    ap.add_argument("--cache", default="data/pop909_remi_cache")
    ap.add_argument("--out", default="runs/pop909_remi")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--transpose", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)

    tok = REMI()
    corpus = load_corpus(args.pop909, args.cache, tok)
    names = sorted(corpus)
    val_names = names[::10]                                    # 10% of songs, fixed
    train_names = [n for n in names if n not in set(val_names)]
    train_set = Windows([corpus[n] for n in train_names], args.seq_len, tok.pitch_base, len(tok.PITCHES), args.transpose)
    val_set = Windows([corpus[n] for n in val_names], args.seq_len, tok.pitch_base, len(tok.PITCHES))

    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))), batch_size=args.batch,
                            num_workers=2)

    model = REMILM(len(tok), max_len=args.seq_len).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr * world / 4, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world / 4, total_steps=total, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        run_loss, n = 0.0, 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(ddp(x).float().transpose(1, 2), y, ignore_index=0)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            run_loss, n = run_loss + loss.item(), n + 1

        ppl, note_acc = validate(model, val_loader, device, tok)
        if rank == 0:
            print(f"[{epoch:03d}] train {run_loss / n:.4f}  val ppl {ppl:.2f}  pitch acc {note_acc:.3f}", flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if ppl < best:
                best = ppl
                torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
            if epoch % 10 == 9:
                model.eval()
                ids = sample(model, tok, device)
                model.train()
                tok.decode(ids).write(os.path.join(args.out, f"sample_{epoch:03d}.mid"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
