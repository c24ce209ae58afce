"""Composer-conditioned Music Transformer on MAESTRO (REMI), 2048-token context with activation checkpointing.

torchrun --nproc_per_node=8 20_long_context_music_tf.py conf=configs/mt_2k.yaml
(any config key can be overridden on the command line, e.g. train.batch_size=4)
"""
import math
import os
import sys
import time
from collections import Counter

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from miditok import REMI, TokenizerConfig
from omegaconf import OmegaConf
from symusic import Score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

DEFAULT = OmegaConf.create({
    "data": {"maestro": "data/maestro-v3.0.0", "cache": "data/maestro_remi_2k.npz", "min_pieces": 20},
    "model": {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 2048, "dropout": 0.1,
              "grad_checkpointing": True},
    "train": {"batch_size": 2, "lr": 2e-4, "warmup": 2000, "epochs": 40, "transpose": 5, "out": "runs/mt_2k"},
})


class RelGlobalAttention(nn.Module):
    def __init__(self, d, h, max_len, p):
        super().__init__()
        self.h, self.dh, self.max_len = h, d // h, max_len
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.Er = nn.Parameter(torch.randn(max_len, self.dh) * self.dh ** -0.5)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        qe = torch.matmul(q, self.Er[self.max_len - l:].transpose(0, 1))
        srel = F.pad(qe, (1, 0)).reshape(b, self.h, l + 1, l)[:, :, 1:, :]
        logits = (torch.matmul(q, k.transpose(-1, -2)) + srel) / math.sqrt(self.dh)
        logits = logits.masked_fill(torch.ones(l, l, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = torch.matmul(self.drop(logits.softmax(-1)), v)
        return self.out(y.transpose(1, 2).reshape(b, l, d))


class DecoderBlock(nn.Module):
    def __init__(self, d, h, max_len, p):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = RelGlobalAttention(d, h, max_len, p)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class ComposerMusicTransformer(nn.Module):
    def __init__(self, vocab, n_composers, cfg):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.gradient_checkpointing = cfg.grad_checkpointing
        self.tok_emb = nn.Embedding(vocab, cfg.d_model)
        self.composer_emb = nn.Embedding(n_composers, cfg.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(cfg.d_model, cfg.n_heads, cfg.seq_len, cfg.dropout)
                                    for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab, bias=False)

    def forward(self, x, composer):
        h = self.tok_emb(x)
        known = composer >= 0
        if known.any():   # rare composers are trained unconditionally
            h = h + self.composer_emb(composer.clamp(min=0))[:, None, :] * known[:, None, None]
        for blk in self.blocks:
            if self.gradient_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(blk, h)
            else:
                h = blk(h)
        return self.head(self.ln_f(h))


class MaestroWindows(Dataset):
    def __init__(self, pieces, composers, seq_len, pitch_lo, pitch_hi, transpose=0):
        self.pieces, self.composers, self.seq_len = pieces, composers, seq_len
        self.lo, self.hi, self.transpose = pitch_lo, pitch_hi, transpose
        self.index = [(i, s) for i, p in enumerate(pieces) for s in range(0, max(1, len(p) - seq_len), seq_len // 2)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        w = self.pieces[i][s:s + self.seq_len + 1].astype(np.int64)
        if self.transpose:
            m = (w >= self.lo) & (w <= self.hi)
            if m.any():
                t = np.random.randint(-self.transpose, self.transpose + 1)
                if w[m].min() + t >= self.lo and w[m].max() + t <= self.hi:
                    w[m] += t
        x = np.zeros(self.seq_len + 1, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x), torch.tensor(self.composers[i])


def load_maestro(cfg, tok, rank):
    meta = pd.read_csv(os.path.join(cfg.maestro, "maestro-v3.0.0.csv")).sort_values("midi_filename")
    counts = Counter(meta.canonical_composer)
    names = sorted(c for c, n in counts.items() if n >= cfg.min_pieces)
    if rank == 0 and not os.path.exists(cfg.cache):
        seqs = []
        for f in meta.midi_filename:
            s = tok.encode(Score(os.path.join(cfg.maestro, f)))
            s = s[0] if isinstance(s, list) else s
            seqs.append(np.asarray([tok["BOS_None"], *s.ids, tok["EOS_None"]], dtype=np.int16))
        np.savez(cfg.cache + ".tmp.npz", *seqs)
        os.replace(cfg.cache + ".tmp.npz", cfg.cache)
    dist.barrier()
    arr = np.load(cfg.cache)
    seqs = [arr[f"arr_{i}"] for i in range(len(meta))]
    comp = [names.index(c) if c in names else -1 for c in meta.canonical_composer]
    split = {}
    for part in ("train", "validation"):
        sel = np.where(meta.split.values == part)[0]
        split[part] = ([seqs[i] for i in sel], [comp[i] for i in sel])
    return split, names


def main():
    cfg = OmegaConf.merge(DEFAULT, OmegaConf.from_cli(sys.argv[1:]))
    if "conf" in cfg:
        cfg = OmegaConf.merge(DEFAULT, OmegaConf.load(cfg.conf), OmegaConf.from_cli(sys.argv[1:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = REMI(TokenizerConfig(num_velocities=32, use_tempos=True, use_sustain_pedals=True,
                               special_tokens=["PAD", "BOS", "EOS"]))
    pitch = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    split, composers = load_maestro(cfg.data, tok, rank)
    tc = cfg.train
    train_ds = MaestroWindows(*split["train"], cfg.model.seq_len, pitch[0], pitch[-1], tc.transpose)
    val_ds = MaestroWindows(*split["validation"], cfg.model.seq_len, pitch[0], pitch[-1])
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, tc.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), tc.batch_size, num_workers=2)

    net = ComposerMusicTransformer(len(tok.vocab), len(composers), cfg.model).to(device)
    # composer_emb is unused whenever a batch holds only rare composers
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    lr = tc.lr * world * tc.batch_size / 16
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    total = tc.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / tc.warmup, 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
    if rank == 0:
        os.makedirs(tc.out, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(tc.out, "config.yaml"))

    best = float("inf")
    for epoch in range(tc.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, comp) in enumerate(train_dl):
            x, comp = x.to(device, non_blocking=True), comp.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[:, :-1], comp)
            loss = F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} {i}/{len(train_dl)} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)

        net.eval()
        s = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, comp in val_dl:
                x, comp = x.to(device), comp.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    lg = net(x[:, :-1], comp).float()
                s[0] += F.cross_entropy(lg.transpose(1, 2), x[:, 1:], ignore_index=0, reduction="sum")
                s[1] += (x[:, 1:] != 0).sum()
        dist.all_reduce(s)
        ppl = math.exp(s[0] / s[1])
        if rank == 0:
            print(f"epoch {epoch} val ppl {ppl:.3f}", flush=True)
            torch.save({"model": net.state_dict(), "composers": composers, "epoch": epoch},
                       os.path.join(tc.out, "last.pt"))
            if ppl < best:
                best = ppl
                torch.save({"model": net.state_dict(), "composers": composers, "epoch": epoch},
                           os.path.join(tc.out, "best.pt"))
            if epoch % 5 == 0:
                with torch.no_grad():
                    for c in ("Frédéric Chopin", "Johann Sebastian Bach"):
                        if c not in composers:
                            continue
                        seq = torch.tensor([[tok["BOS_None"]]], device=device)
                        cid = torch.tensor([composers.index(c)], device=device)
                        for _ in range(1024):
                            with torch.autocast("cuda", dtype=torch.bfloat16):
                                lg = net(seq[:, -cfg.model.seq_len:], cid)[0, -1].float()
                            v, ix = lg.topk(32)
                            seq = torch.cat([seq, ix[torch.multinomial(v.softmax(-1), 1)].view(1, 1)], 1)
                        tok.decode([seq[0, 1:].tolist()]).dump_midi(
                            os.path.join(tc.out, f"ep{epoch:02d}_{c.split()[-1]}.mid"))
        net.train()
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
