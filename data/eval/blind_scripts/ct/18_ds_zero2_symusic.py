"""REMI piano LM on the GigaMIDI piano subset, fast MIDI parsing with symusic, DeepSpeed ZeRO-2 (bf16).

deepspeed --num_gpus 8 18_ds_zero2_symusic.py --midi_root data/gigamidi_piano --out runs/giga_zero2
"""
import argparse
import hashlib
import math
import os
import pickle

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from symusic import Note, Score, Track
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

# ---------------------------------------------------------------- vocabulary
SPECIAL = ["PAD", "BOS", "EOS", "Bar"]
POS = [f"Pos_{i}" for i in range(16)]
PITCH = [f"Pitch_{p}" for p in range(21, 109)]
VEL = [f"Vel_{i}" for i in range(16)]
DUR = [f"Dur_{i}" for i in range(1, 65)]
ITOS = SPECIAL + POS + PITCH + VEL + DUR
STOI = {t: i for i, t in enumerate(ITOS)}
PITCH_LO, PITCH_HI = STOI["Pitch_21"], STOI["Pitch_108"]


def encode(path):
    score = Score(path).resample(tpq=4, min_dur=1)          # 16th-note grid
    notes = sorted((n for t in score.tracks if not t.is_drum for n in t.notes), key=lambda n: (n.time, n.pitch))
    ids, bar, pos = [STOI["BOS"]], -1, -1
    for n in notes:
        if not 21 <= n.pitch <= 108:
            continue
        b, p = divmod(n.time, 16)
        while bar < b:
            ids.append(STOI["Bar"])
            bar, pos = bar + 1, -1
        if p != pos:
            ids.append(STOI[f"Pos_{p}"])
            pos = p
        ids += [STOI[f"Pitch_{n.pitch}"], STOI[f"Vel_{n.velocity // 8}"], STOI[f"Dur_{min(max(n.duration, 1), 64)}"]]
    ids.append(STOI["EOS"])
    return np.asarray(ids, dtype=np.int16)


def decode(ids, path):
    track = Track(name="piano", program=0)
    bar, pos, pitch, vel = -1, 0, None, 64
    for i in ids:
        t = ITOS[i]
        if t == "Bar":
            bar += 1
        elif t.startswith("Pos_"):
            pos = int(t[4:])
        elif t.startswith("Pitch_"):
            pitch = int(t[6:])
        elif t.startswith("Vel_"):
            vel = int(t[4:]) * 8 + 4
        elif t.startswith("Dur_") and pitch is not None:
            track.notes.append(Note(max(bar, 0) * 16 + pos, int(t[4:]), pitch, vel))
            pitch = None
    score = Score(4)
    score.tracks.append(track)
    score.dump_midi(path)


class Windows(Dataset):
    def __init__(self, pieces, seq_len, transpose=0):
        self.pieces, self.seq_len, self.transpose = pieces, seq_len, transpose
        self.idx = [(i, s) for i, p in enumerate(pieces) for s in range(0, max(1, len(p) - seq_len // 2), seq_len)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i, s = self.idx[k]
        w = self.pieces[i][s:s + self.seq_len + 1].astype(np.int64)
        if self.transpose:
            m = (w >= PITCH_LO) & (w <= PITCH_HI)
            if m.any():
                t = np.random.randint(-self.transpose, self.transpose + 1)
                if w[m].min() + t >= PITCH_LO and w[m].max() + t <= PITCH_HI:
                    w[m] += t
        x = np.zeros(self.seq_len + 1, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x)


class PianoLM(nn.Module):
    def __init__(self, d=1024, layers=16, heads=16, seq_len=1024, dropout=0.1):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(len(ITOS), d)
        self.pos = nn.Embedding(seq_len, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, "gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, len(ITOS), bias=False)

    def forward(self, x):
        l = x.size(1)
        h = self.tok(x) + self.pos(torch.arange(l, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(l, device=x.device, dtype=h.dtype)
        return self.lm_head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def build_corpus(root, cache):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith((".mid", ".midi")))
    data = {"train": [], "valid": []}
    for f in tqdm(files, desc="tokenising"):
        try:
            ids = encode(f)
        except Exception:
            continue
        if len(ids) < 64:
            continue
        h = int(hashlib.sha1(os.path.basename(f).encode()).hexdigest()[:8], 16)
        data["valid" if h % 100 < 2 else "train"].append(ids)
    with open(cache + ".tmp", "wb") as fh:
        pickle.dump(data, fh)
    os.replace(cache + ".tmp", cache)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--midi_root", required=True)
    ap.add_argument("--out", default="runs/giga_zero2")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--micro_bs", type=int, default=8)
    ap.add_argument("--global_bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = ap.parse_args()

    torch.cuda.set_device(args.local_rank)
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    cache = os.path.join(args.out, "corpus.pkl")
    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        if not os.path.exists(cache):
            build_corpus(args.midi_root, cache)
    dist.barrier()
    with open(cache, "rb") as fh:
        data = pickle.load(fh)

    train_ds = Windows(data["train"], args.seq_len, transpose=6)
    val_ds = Windows(data["valid"], args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=3)
    train_dl = DataLoader(train_ds, args.micro_bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.micro_bs, num_workers=2)

    grad_accum = args.global_bs // (args.micro_bs * world)
    assert grad_accum >= 1 and grad_accum * args.micro_bs * world == args.global_bs, "global_bs must divide evenly"
    updates = args.epochs * len(train_dl) // grad_accum
    ds_config = {
        "train_batch_size": args.global_bs,
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "allgather_bucket_size": 2e8, "reduce_bucket_size": 2e8},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-8,
                                                   "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": updates, "warmup_num_steps": max(1, updates // 50)}},
        "steps_per_print": 500,
    }
    model = PianoLM(seq_len=args.seq_len)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    start_epoch = 0
    if args.resume:
        # every rank loads its own ZeRO-2 optimizer partition
        _, client = engine.load_checkpoint(args.out, tag="latest_ckpt")
        start_epoch = client["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for i, seq in enumerate(train_dl):
            seq = seq.to(device, non_blocking=True)
            logits = engine(seq[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=STOI["PAD"])
            engine.backward(loss)
            engine.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e}", flush=True)

        # ZeRO-2 keeps a full bf16 copy of the weights on every rank, so the bare module works for eval
        net = engine.module
        net.eval()
        s = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for seq in val_dl:
                seq = seq.to(device)
                y = seq[:, 1:]
                lg = net(seq[:, :-1]).float()
                pm = (y >= PITCH_LO) & (y <= PITCH_HI)
                s += torch.stack([F.cross_entropy(lg.transpose(1, 2), y, ignore_index=0, reduction="sum").double(),
                                  (y != 0).sum().double(), ((lg.argmax(-1) == y) & pm).sum().double(),
                                  pm.sum().double()])
        dist.all_reduce(s)
        if rank == 0:
            print(f"epoch {epoch}: valid ppl {math.exp(s[0] / s[1]):.3f} pitch acc {s[2] / s[3]:.4f}", flush=True)
            seq = torch.tensor([[STOI["BOS"]]], device=device)
            with torch.no_grad():
                for _ in range(1024):
                    lg = net(seq[:, -args.seq_len:])[0, -1].float()
                    v, ix = lg.topk(24)
                    seq = torch.cat([seq, ix[torch.multinomial(v.softmax(-1), 1)].view(1, 1)], 1)
            decode(seq[0].tolist(), os.path.join(args.out, "samples", f"epoch{epoch:02d}.mid"))
        net.train()
        # collective: all ranks write their shard of the checkpoint
        engine.save_checkpoint(args.out, tag="latest_ckpt", client_state={"epoch": epoch})

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
