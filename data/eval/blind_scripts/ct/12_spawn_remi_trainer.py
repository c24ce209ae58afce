"""REMI (Huang & Yang, 2020) pop-piano model, event extraction with miditoolkit, multi-GPU via mp.spawn.

    python 12_spawn_remi_trainer.py --midi_dir data/pop_piano_covers --out runs/remi_pop
"""
import argparse
import glob
import math
import os
import pickle
import random

import miditoolkit
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TICKS_PER_BAR = 1920
POSITIONS = 16
DUR_BINS = np.arange(60, 3841, 60)
VEL_BINS = np.linspace(0, 128, 33, dtype=int)[1:]
TEMPO_BINS = np.arange(30, 211, 6)


def build_vocab():
    ev = ["PAD", "BOS", "EOS", "Bar"]
    ev += [f"Position_{i + 1}/{POSITIONS}" for i in range(POSITIONS)]
    ev += [f"Note-Velocity_{i}" for i in range(len(VEL_BINS))]
    ev += [f"Note-On_{p}" for p in range(21, 109)]
    ev += [f"Note-Duration_{i}" for i in range(len(DUR_BINS))]
    ev += [f"Tempo_{i}" for i in range(len(TEMPO_BINS))]
    return {e: i for i, e in enumerate(ev)}


def midi_to_events(path):
    midi = miditoolkit.midi.parser.MidiFile(path)
    scale = TICKS_PER_BAR / 4 / midi.ticks_per_beat     # normalise to 480 ticks per beat
    notes = sorted((n for inst in midi.instruments if not inst.is_drum for n in inst.notes),
                   key=lambda n: (n.start, n.pitch))
    tempos = sorted(midi.tempo_changes, key=lambda t: t.time)
    events, grid = [], TICKS_PER_BAR // POSITIONS
    max_tick = int(max((n.end for n in notes), default=0) * scale)
    ni, ti = 0, 0
    for bar_start in range(0, max_tick + 1, TICKS_PER_BAR):
        events.append("Bar")
        bar_notes = []
        while ni < len(notes) and int(notes[ni].start * scale) < bar_start + TICKS_PER_BAR:
            bar_notes.append(notes[ni])
            ni += 1
        last_pos = None
        for n in bar_notes:
            st = int(n.start * scale)
            pos = min(round((st - bar_start) / grid), POSITIONS - 1)
            if pos != last_pos:
                events.append(f"Position_{pos + 1}/{POSITIONS}")
                while ti < len(tempos) and tempos[ti].time * scale <= st:
                    events.append(f"Tempo_{int(np.abs(TEMPO_BINS - tempos[ti].tempo).argmin())}")
                    ti += 1
                last_pos = pos
            if not 21 <= n.pitch <= 108:
                continue
            events.append(f"Note-Velocity_{int(np.searchsorted(VEL_BINS, n.velocity))}")
            events.append(f"Note-On_{n.pitch}")
            dur = int((n.end - n.start) * scale)
            events.append(f"Note-Duration_{int(np.abs(DUR_BINS - dur).argmin())}")
    return events


def events_to_midi(words, itos, path, bpm=110):
    midi = miditoolkit.midi.parser.MidiFile()
    midi.ticks_per_beat = TICKS_PER_BAR // 4
    inst = miditoolkit.midi.containers.Instrument(0, is_drum=False, name="piano")
    bar, pos, vel, pitch = -1, 0, 64, None
    for w in words:
        e = itos[w]
        if e == "Bar":
            bar += 1
        elif e.startswith("Position_"):
            pos = int(e.split("_")[1].split("/")[0]) - 1
        elif e.startswith("Note-Velocity_"):
            vel = int(VEL_BINS[int(e.split("_")[1])]) - 2
        elif e.startswith("Note-On_"):
            pitch = int(e.split("_")[1])
        elif e.startswith("Note-Duration_") and pitch is not None:
            st = max(bar, 0) * TICKS_PER_BAR + pos * (TICKS_PER_BAR // POSITIONS)
            inst.notes.append(miditoolkit.midi.containers.Note(vel, pitch, st, st + int(DUR_BINS[int(e.split("_")[1])])))
            pitch = None
    midi.instruments.append(inst)
    midi.tempo_changes.append(miditoolkit.midi.containers.TempoChange(bpm, 0))
    midi.dump(path)


class SegmentDataset(Dataset):
    def __init__(self, songs, seq_len, note_on_base, shift=0):
        self.songs, self.seq_len, self.base, self.shift = songs, seq_len, note_on_base, shift
        self.segs = [(i, s) for i, w in enumerate(songs) for s in range(0, max(1, len(w) - seq_len), seq_len // 2)]

    def __len__(self):
        return len(self.segs)

    def __getitem__(self, k):
        i, s = self.segs[k]
        w = self.songs[i][s:s + self.seq_len + 1].copy()
        if self.shift:
            on = (w >= self.base) & (w < self.base + 88)
            if on.any():
                t = random.randint(-self.shift, self.shift)
                if w[on].min() + t >= self.base and w[on].max() + t < self.base + 88:
                    w[on] += t
        x = np.zeros(self.seq_len + 1, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x)


class REMIModel(nn.Module):
    def __init__(self, n_token, d=512, n_layer=12, n_head=8, max_len=512, dropout=0.1):
        super().__init__()
        self.max_len = max_len
        self.word_emb = nn.Embedding(n_token, d)
        self.pos_emb = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, n_head, 2048, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer)
        self.out = nn.Linear(d, n_token)

    def forward(self, x):
        l = x.size(1)
        h = self.word_emb(x) + self.pos_emb(torch.arange(l, device=x.device))
        causal = nn.Transformer.generate_square_subsequent_mask(l, device=x.device)
        return self.out(self.encoder(h, mask=causal, is_causal=True))


@torch.no_grad()
def sample_song(net, stoi, device, n_bars=16, temperature=1.2, topk=5):
    words = [stoi["BOS"], stoi["Bar"]]
    bars = 1
    while bars < n_bars and len(words) < 4096:
        x = torch.tensor([words[-net.max_len:]], device=device)
        logits = net(x)[0, -1] / temperature
        v, i = logits.topk(topk)
        w = i[torch.multinomial(v.softmax(-1), 1)].item()
        words.append(w)
        bars += int(w == stoi["Bar"])
    return words


def main_worker(gpu, cfg, world_size):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(cfg.port))
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", rank=gpu, world_size=world_size)
    device = torch.device("cuda", gpu)

    stoi = build_vocab()
    itos = {i: e for e, i in stoi.items()}
    with open(cfg.cache, "rb") as f:
        songs = pickle.load(f)
    names = sorted(songs)
    val = set(names[-cfg.n_val:])
    enc = lambda ev: np.array([stoi["BOS"]] + [stoi[e] for e in ev] + [stoi["EOS"]], dtype=np.int64)
    train_ds = SegmentDataset([enc(songs[n]) for n in names if n not in val], cfg.seq_len, stoi["Note-On_21"], shift=5)
    val_ds = SegmentDataset([enc(songs[n]) for n in names if n in val], cfg.seq_len, stoi["Note-On_21"])
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=gpu, shuffle=True)
    dl = DataLoader(train_ds, cfg.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(gpu, len(val_ds), world_size)), cfg.batch_size)

    model = DDP(REMIModel(len(stoi), max_len=cfg.seq_len).to(device), device_ids=[gpu])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr * world_size)
    note_on = torch.zeros(len(stoi), dtype=torch.bool, device=device)
    note_on[stoi["Note-On_21"]:stoi["Note-On_108"] + 1] = True

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for seq in dl:
            seq = seq.to(device, non_blocking=True)
            loss = F.cross_entropy(model(seq[:, :-1]).transpose(1, 2), seq[:, 1:], ignore_index=stoi["PAD"])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        model.eval()
        t = torch.zeros(4, device=device)
        with torch.no_grad():
            for seq in val_dl:
                seq = seq.to(device)
                y = seq[:, 1:]
                lg = model.module(seq[:, :-1])
                t[0] += F.cross_entropy(lg.transpose(1, 2), y, ignore_index=stoi["PAD"], reduction="sum")
                t[1] += (y != stoi["PAD"]).sum()
                t[2] += ((lg.argmax(-1) == y) & note_on[y]).sum()
                t[3] += note_on[y].sum()
        dist.all_reduce(t)
        if gpu == 0:
            print(f"epoch {epoch}: train loss {loss.item():.3f} val ppl {math.exp(t[0] / t[1]):.2f} "
                  f"note-on acc {t[2] / t[3]:.3f}", flush=True)
            torch.save(model.module.state_dict(), os.path.join(cfg.out, f"epoch_{epoch:03d}.pt"))
            if epoch % 20 == 19:
                words = sample_song(model.module, stoi, device)
                events_to_midi(words, itos, os.path.join(cfg.out, f"sample_{epoch:03d}.mid"))
        dist.barrier()

    dist.destroy_process_group()


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--midi_dir", default="data/pop_piano_covers")
    ap.add_argument("--cache", default="data/pop_piano_events.pkl")
    ap.add_argument("--out", default="runs/remi_pop")
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--n_val", type=int, default=40)
    ap.add_argument("--port", type=int, default=29533)
    return ap.parse_args()


if __name__ == "__main__":
    cfg = parse()
    os.makedirs(cfg.out, exist_ok=True)
    if not os.path.exists(cfg.cache):
        songs = {}
        for p in sorted(glob.glob(os.path.join(cfg.midi_dir, "*.mid"))):
            songs[os.path.basename(p)] = midi_to_events(p)
        with open(cfg.cache, "wb") as f:
            pickle.dump(songs, f)
    world_size = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=world_size, args=(world_size, cfg))
