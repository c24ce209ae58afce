#!/usr/bin/env python3
# Music Transformer on MAESTRO with the performance-event vocabulary of Oore et al.
# (NOTE_ON x128, NOTE_OFF x128, TIME_SHIFT x100 (10 ms), SET_VELOCITY x32) and relative global attention.
#
#   torchrun --nproc_per_node=8 04_maestro_relative_attn.py --data data/maestro-v3.0.0 --save runs/mt_perf
import argparse
import glob
import json
import math
import os
import random
import time

import numpy as np
import pretty_midi
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NOTE_ON, NOTE_OFF, SHIFT, VEL = 0, 128, 256, 356
PAD, EOS = 388, 389
VOCAB = 390


def encode_performance(path):
    pm = pretty_midi.PrettyMIDI(path)
    ev = []
    for inst in pm.instruments:
        for n in inst.notes:
            ev.append((n.start, 1, n.pitch, n.velocity))
            ev.append((n.end, 0, n.pitch, 0))
    ev.sort()
    out, t, vel = [], 0.0, -1
    for time_s, is_on, pitch, v in ev:
        steps = int(round((time_s - t) * 100))
        while steps > 0:
            s = min(steps, 100)
            out.append(SHIFT + s - 1)
            steps -= s
        t = time_s
        if is_on:
            vb = v * 32 // 128
            if vb != vel:
                out.append(VEL + vb)
                vel = vb
            out.append(NOTE_ON + pitch)
        else:
            out.append(NOTE_OFF + pitch)
    out.append(EOS)
    return np.asarray(out, dtype=np.int16)


def decode_performance(ids):
    pm = pretty_midi.PrettyMIDI()
    piano = pretty_midi.Instrument(0)
    t, vel, active = 0.0, 64, {}
    for i in ids:
        if i >= PAD:
            break
        if i < NOTE_OFF:
            active[i] = (t, vel)
        elif i < SHIFT:
            p = i - NOTE_OFF
            if p in active:
                st, v = active.pop(p)
                if t > st:
                    piano.notes.append(pretty_midi.Note(v, p, st, t))
        elif i < VEL:
            t += (i - SHIFT + 1) / 100
        else:
            vel = (i - VEL) * 4 + 2
    pm.instruments.append(piano)
    return pm


def transpose(seq, k):
    if k == 0:
        return seq
    on = seq < NOTE_OFF
    off = (seq >= NOTE_OFF) & (seq < SHIFT)
    pitches = np.concatenate([seq[on], seq[off] - NOTE_OFF])
    if len(pitches) and (pitches.min() + k < 21 or pitches.max() + k > 108):
        return seq
    seq = seq.copy()
    seq[on | off] += k
    return seq


class PerformanceWindows(Dataset):
    def __init__(self, files, seq_len, augment):
        self.seq_len, self.augment = seq_len, augment
        self.pieces = [np.load(f).astype(np.int64) for f in files]
        self.windows = []
        for pi, p in enumerate(self.pieces):
            n = max(1, (len(p) - 1) // seq_len)
            self.windows += [(pi, j * seq_len) for j in range(n)]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        pi, start = self.windows[i]
        p = self.pieces[pi]
        if self.augment:  # random offset inside the piece, Music Transformer style
            start = random.randint(0, max(0, len(p) - self.seq_len - 1))
            seg = transpose(p[start:start + self.seq_len + 1], random.randint(-3, 3))
        else:
            seg = p[start:start + self.seq_len + 1]
        x = np.full(self.seq_len + 1, PAD, dtype=np.int64)
        x[:len(seg)] = seg
        return torch.from_numpy(x[:-1]), torch.from_numpy(x[1:])


class RelMHA(nn.Module):
    def __init__(self, d, h, max_len, p):
        super().__init__()
        self.h, self.dk, self.max_len = h, d // h, max_len
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))
        self.E = nn.Embedding(max_len, self.dk)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, l, d = x.shape
        split = lambda t: t.view(b, l, self.h, self.dk).transpose(1, 2)
        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        e = self.E.weight[self.max_len - l:]
        qe = torch.einsum("bhld,md->bhlm", q, e)
        qe = qe * torch.ones(l, l, device=x.device).tril().flip(1)   # zero out positions that the skew wraps
        srel = F.pad(qe, (1, 0)).reshape(b, self.h, l + 1, l)[:, :, 1:]
        logits = (q @ k.transpose(-1, -2) + srel) / math.sqrt(self.dk)
        logits = logits.masked_fill(torch.triu(torch.ones(l, l, dtype=torch.bool, device=x.device), 1), -1e9)
        att = self.drop(F.softmax(logits, dim=-1))
        return self.wo((att @ v).transpose(1, 2).reshape(b, l, d))


class DecoderLayer(nn.Module):
    def __init__(self, d, h, max_len, p):
        super().__init__()
        self.mha = RelMHA(d, h, max_len, p)
        self.ffn = nn.Sequential(nn.Linear(d, d * 2), nn.ReLU(), nn.Linear(d * 2, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.d1, self.d2 = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        x = self.n1(x + self.d1(self.mha(x)))
        return self.n2(x + self.d2(self.ffn(x)))


class MusicTransformer(nn.Module):
    def __init__(self, d=512, layers=6, heads=8, max_len=2048, p=0.1):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, max_len, p) for _ in range(layers))
        self.fc = nn.Linear(d, VOCAB)
        self.d = d

    def forward(self, x):
        h = self.embed(x) * math.sqrt(self.d)
        for layer in self.layers:
            h = layer(h)
        return self.fc(h)

    @torch.no_grad()
    def generate(self, primer, length, temperature=1.0, top_p=0.95):
        out = primer
        for _ in range(length):
            logits = self(out[:, -self.max_len:])[:, -1, :VOCAB - 2] / temperature
            probs = F.softmax(logits, -1)
            sp, si = torch.sort(probs, descending=True)
            sp[sp.cumsum(-1) - sp > top_p] = 0.0
            out = torch.cat([out, si.gather(-1, torch.multinomial(sp, 1))], dim=1)
        return out


class Trainer:
    def __init__(self, args, rank, local_rank, world):
        self.args, self.rank, self.world = args, rank, world
        self.device = torch.device("cuda", local_rank)
        files = sorted(glob.glob(os.path.join(args.cache, "*.npy")))
        with open(os.path.join(args.data, "maestro-v3.0.0.json")) as f:
            meta = json.load(f)
        split_of = {os.path.splitext(os.path.basename(meta["midi_filename"][k]))[0]: meta["split"][k]
                    for k in meta["split"]}
        pick = lambda s: [f for f in files if split_of[os.path.basename(f)[:-4]] == s]
        self.train_ds = PerformanceWindows(pick("train"), args.seq_len, augment=True)
        self.val_ds = PerformanceWindows(pick("validation"), args.seq_len, augment=False)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True)
        self.val_sampler = DistributedSampler(self.val_ds, shuffle=False, drop_last=True)
        self.train_dl = DataLoader(self.train_ds, args.batch_size, sampler=self.sampler, num_workers=4,
                                   pin_memory=True, drop_last=True)
        self.val_dl = DataLoader(self.val_ds, args.batch_size, sampler=self.val_sampler, num_workers=2)
        net = MusicTransformer(args.d_model, args.layers, args.heads, args.seq_len).to(self.device)
        self.model = DDP(net, device_ids=[local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        # Noam schedule; the global batch is args.batch_size * world
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: args.d_model ** -0.5 * min((s + 1) ** -0.5, (s + 1) * args.warmup ** -1.5)
            * math.sqrt(world * args.batch_size / 16))
        self.step = 0

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        t0 = time.time()
        for x, y in self.train_dl:
            x, y = x.to(self.device), y.to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD,
                                   label_smoothing=0.1)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.step += 1
            if self.rank == 0 and self.step % 100 == 0:
                print(f"ep {epoch} step {self.step} loss {loss.item():.4f} lr {self.sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        tot = torch.zeros(3, device=self.device)
        for x, y in self.val_dl:
            x, y = x.to(self.device), y.to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x).float()
            mask = y != PAD
            tot[0] += F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD, reduction="sum")
            tot[1] += mask.sum()
            tot[2] += ((logits.argmax(-1) == y) & mask).sum()
        dist.all_reduce(tot)
        return (tot[0] / tot[1]).item(), (tot[2] / tot[1]).item()

    def sample(self, epoch):
        primer = torch.tensor(self.val_ds.pieces[0][:256], device=self.device)[None]
        gen = self.model.generate(primer, self.args.gen_len)
        decode_performance(gen[0].tolist()).write(os.path.join(self.args.save, f"sample_ep{epoch:03d}.mid"))

    def save(self, epoch, name):
        torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "epoch": epoch, "step": self.step},
                   os.path.join(self.args.save, name))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/maestro-v3.0.0")
    ap.add_argument("--cache", default="data/maestro_perf_npy")
    ap.add_argument("--save", default="runs/mt_perf")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--gen_len", type=int, default=1024)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        if not glob.glob(os.path.join(args.cache, "*.npy")):
            os.makedirs(args.cache, exist_ok=True)
            for mid in sorted(glob.glob(os.path.join(args.data, "**", "*.midi"), recursive=True)):
                name = os.path.splitext(os.path.basename(mid))[0]
                np.save(os.path.join(args.cache, name + ".npy"), encode_performance(mid))
    dist.barrier()

    trainer = Trainer(args, rank, local_rank, world)
    best = float("inf")
    for epoch in range(args.epochs):
        trainer.train_epoch(epoch)
        val_loss, val_acc = trainer.validate()
        if rank == 0:
            print(f"== epoch {epoch}: val nll {val_loss:.4f} ppl {math.exp(val_loss):.2f} acc {val_acc:.4f}", flush=True)
            trainer.save(epoch, "last.pt")
            if val_loss < best:
                best = val_loss
                trainer.save(epoch, "best.pt")
            if epoch % 5 == 0:
                trainer.model.eval()
                trainer.sample(epoch)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
