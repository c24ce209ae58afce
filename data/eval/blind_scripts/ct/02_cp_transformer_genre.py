"""Genre-conditioned Compound Word Transformer on Lakh MIDI (tagtraum genre labels where available).

torchrun --standalone --nproc_per_node=4 02_cp_transformer_genre.py --config configs/cp_genre.yaml
"""
import argparse
import hashlib
import json
import logging
import math
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from miditok import CPWord, TokenizerConfig
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("cp_genre")


@dataclass
class Config:
    midi_root: str = "data/lmd_full"
    genre_json: str = "data/tagtraum_cd2c.json"
    out_dir: str = "runs/cp_genre"
    seq_len: int = 512
    emb_sizes: list = field(default_factory=lambda: [32, 128, 256, 64, 128, 32])
    d_model: int = 512
    n_layers: int = 12
    n_heads: int = 8
    dropout: float = 0.1
    batch_size: int = 16          # per GPU
    lr: float = 3e-4
    warmup: int = 2000
    max_steps: int = 200_000
    eval_every: int = 5000
    sample_every: int = 10000
    transpose: int = 6
    num_workers: int = 6
    resume: str = ""


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)
    return cfg


def is_val(path):
    return int(hashlib.md5(Path(path).stem.encode()).hexdigest(), 16) % 50 == 0


def build_corpus(cfg, tokenizer):
    with open(cfg.genre_json) as f:
        genres = json.load(f)              # md5 -> genre name, only part of LMD is labelled
    names = sorted(set(genres.values()))
    g2i = {g: i for i, g in enumerate(names)}
    corpus = {"train": [], "val": [], "genres": names}
    for path in sorted(Path(cfg.midi_root).rglob("*.mid")):
        try:
            seqs = tokenizer.encode(path)
        except Exception:
            continue
        ids = np.asarray(seqs[0].ids if isinstance(seqs, list) else seqs.ids, dtype=np.int16)
        if len(ids) < 64:
            continue
        label = g2i.get(genres.get(path.stem), -1)
        corpus["val" if is_val(path) else "train"].append((ids, label))
    return corpus


class CPWindows(Dataset):
    def __init__(self, items, seq_len, pitch_shift=None, transpose=0):
        self.items, self.seq_len = items, seq_len
        self.pitch_shift, self.transpose = pitch_shift, transpose
        self.index = [(i, s) for i, (ids, _) in enumerate(items)
                      for s in range(0, max(len(ids) - seq_len, 1), seq_len // 2)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        ids, genre = self.items[i]
        win = ids[s:s + self.seq_len + 1].astype(np.int64)
        if self.pitch_shift is not None and self.transpose:
            win = self.pitch_shift(win, np.random.randint(-self.transpose, self.transpose + 1))
        out = np.zeros((self.seq_len + 1, win.shape[1]), dtype=np.int64)   # 0 = PAD in every field
        out[:len(win)] = win
        out = torch.from_numpy(out)
        return out[:-1], out[1:], torch.tensor(genre)


class CPPitchShift:
    def __init__(self, tokenizer):
        self.f = tokenizer.vocab_types_idx["Pitch"]
        voc = tokenizer.vocab[self.f]
        by_pitch = {int(t.split("_")[1]): i for t, i in voc.items() if t.startswith("Pitch_")}
        self.pitch_of = {i: p for p, i in by_pitch.items()}
        self.by_pitch = by_pitch

    def __call__(self, win, shift):
        col = win[:, self.f]
        idx = [j for j, t in enumerate(col) if t in self.pitch_of]
        if not idx or shift == 0:
            return win
        new = [self.pitch_of[col[j]] + shift for j in idx]
        if any(p not in self.by_pitch for p in new):
            return win
        win = win.copy()
        win[idx, self.f] = [self.by_pitch[p] for p in new]
        return win


class CPTransformer(nn.Module):
    def __init__(self, vocab_sizes, cfg, n_genres):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(v, e) for v, e in zip(vocab_sizes, cfg.emb_sizes)])
        self.in_proj = nn.Linear(sum(cfg.emb_sizes), cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.genre_emb = nn.Embedding(n_genres, cfg.d_model)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, 4 * cfg.d_model, cfg.dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.heads = nn.ModuleList([nn.Linear(cfg.d_model, v) for v in vocab_sizes])
        self.seq_len = cfg.seq_len

    def forward(self, x, genre):
        b, l, _ = x.shape
        h = self.in_proj(torch.cat([emb(x[..., i]) for i, emb in enumerate(self.embs)], dim=-1))
        h = h + self.pos(torch.arange(l, device=x.device))
        has_genre = genre >= 0
        if has_genre.any():  # unlabelled pieces train the unconditional model
            h = h + self.genre_emb(genre.clamp(min=0))[:, None] * has_genre[:, None, None]
        mask = nn.Transformer.generate_square_subsequent_mask(l, device=x.device)
        h = self.norm(self.encoder(h, mask=mask, is_causal=True))
        return [head(h) for head in self.heads]

    @torch.no_grad()
    def generate(self, prime, genre, n_steps, temperature=1.0, top_p=0.9):
        seq = prime
        for _ in range(n_steps):
            outs = self(seq[:, -self.seq_len:], genre)
            step = []
            for logits in outs:
                probs = (logits[:, -1] / temperature).softmax(-1)
                sp, si = probs.sort(descending=True)
                sp[(sp.cumsum(-1) - sp) > top_p] = 0
                step.append(si.gather(-1, torch.multinomial(sp, 1)))
            seq = torch.cat([seq, torch.stack(step, -1)], dim=1)
        return seq


def cp_loss(outs, y):
    losses = [F.cross_entropy(o.float().transpose(1, 2), y[..., i], ignore_index=0) for i, o in enumerate(outs)]
    return sum(losses), losses


@torch.no_grad()
def evaluate(net, loader, device, pitch_field, pitch_ids):
    net.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)  # nll sum, tokens, pitch hits, pitch tokens
    for x, y, g in loader:
        x, y, g = x.to(device), y.to(device), g.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = net(x, g)
        for i, o in enumerate(outs):
            acc[0] += F.cross_entropy(o.float().transpose(1, 2), y[..., i], ignore_index=0, reduction="sum")
        valid = y[..., 0] != 0
        acc[1] += valid.sum()
        pm = torch.isin(y[..., pitch_field], pitch_ids)
        acc[2] += ((outs[pitch_field].argmax(-1) == y[..., pitch_field]) & pm).sum()
        acc[3] += pm.sum()
    dist.all_reduce(acc)
    net.train()
    return math.exp(acc[0] / acc[1]), (acc[2] / acc[3]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    tokenizer = CPWord(TokenizerConfig(num_velocities=16, use_chords=True, use_tempos=True,
                                       use_programs=False, special_tokens=["PAD", "BOS", "EOS"]))
    cache = Path(cfg.out_dir) / "cp_corpus.pkl"
    if rank == 0:
        Path(cfg.out_dir, "samples").mkdir(parents=True, exist_ok=True)
        if not cache.exists():
            corpus = build_corpus(cfg, tokenizer)
            with open(f"{cache}.tmp", "wb") as f:
                pickle.dump(corpus, f)
            os.replace(f"{cache}.tmp", cache)
    dist.barrier()
    with open(cache, "rb") as f:
        corpus = pickle.load(f)

    shift = CPPitchShift(tokenizer)
    train_set = CPWindows(corpus["train"], cfg.seq_len, shift, cfg.transpose)
    val_set = CPWindows(corpus["val"], cfg.seq_len)
    sampler = DistributedSampler(train_set, shuffle=True, seed=17)
    train_loader = DataLoader(train_set, cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), cfg.batch_size,
                            num_workers=2, pin_memory=True)

    vocab_sizes = [len(v) for v in tokenizer.vocab]
    model = CPTransformer(vocab_sizes, cfg, len(corpus["genres"])).to(device)
    # genre_emb gets no gradient on a rank whose batch has only unlabelled pieces
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    lr = cfg.lr * math.sqrt(world * cfg.batch_size / 16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / cfg.warmup, 0.5 * (1 + math.cos(math.pi * s / cfg.max_steps))))

    step, epoch, best = 0, 0, float("inf")
    if cfg.resume:
        ck = torch.load(cfg.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step, epoch, best = ck["step"], ck["epoch"], ck["best"]

    pitch_field = tokenizer.vocab_types_idx["Pitch"]
    pitch_ids = torch.tensor(sorted(shift.pitch_of), device=device)
    model.train()
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        for x, y, g in train_loader:
            x, y, g = x.to(device, non_blocking=True), y.to(device, non_blocking=True), g.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outs = model(x, g)
            loss, parts = cp_loss(outs, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 200 == 0:
                log.info("step %d loss %.4f (%s)", step, loss.item(), " ".join(f"{p.item():.3f}" for p in parts))

            if step % cfg.eval_every == 0:
                ppl, pacc = evaluate(model.module, val_loader, device, pitch_field, pitch_ids)
                log.info("step %d val ppl %.3f pitch acc %.4f", step, ppl, pacc)
                if rank == 0:
                    ck = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                          "sched": sched.state_dict(), "step": step, "epoch": epoch, "best": min(best, ppl)}
                    torch.save(ck, Path(cfg.out_dir) / "last.pt")
                    if ppl < best:
                        torch.save(ck, Path(cfg.out_dir) / "best.pt")
                best = min(best, ppl)

            if step % cfg.sample_every == 0 and rank == 0:
                net = model.module.eval()
                bos = torch.tensor([[[voc["BOS_None"] for voc in tokenizer.vocab]]], device=device)
                for gi in (0, len(corpus["genres"]) - 1):
                    out = net.generate(bos, torch.tensor([gi], device=device), 768)
                    midi = tokenizer.decode([out[0, 1:].tolist()])
                    midi.dump_midi(Path(cfg.out_dir) / "samples" / f"{step}_{corpus['genres'][gi]}.mid")
                net.train()
            if step >= cfg.max_steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
