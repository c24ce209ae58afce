"""Jazz lead-sheet / solo model on the Weimar Jazz Database + PiJAMA piano solos (REMI with chord tokens).

torchrun --nproc_per_node=4 17_jazz_remi_ddp.py --wjazzd data/wjazzd_midi --pijama data/pijama_midi
"""
import argparse
import logging
import math
import os
import random
import sys
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from miditok import REMI, TokenizerConfig
from symusic import Score
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="[%(asctime)s] %(message)s")
log = logging.getLogger("jazz")


def parse_args():
    parser = argparse.ArgumentParser(description="Jazz REMI transformer")
    parser.add_argument("--wjazzd", default="data/wjazzd_midi")
    parser.add_argument("--pijama", default="data/pijama_midi")
    parser.add_argument("--save_dir", default="runs/jazz_remi")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--max_len", type=int, default=1024)
    parser.add_argument("--n_layer", type=int, default=8)
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--n_head", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--n_epochs", type=int, default=80)
    parser.add_argument("--transpose", type=int, default=6)
    return parser.parse_args()


class JazzSet(Dataset):
    def __init__(self, seqs, max_len, pitch_lo, pitch_hi, transpose=0):
        self.seqs, self.max_len, self.transpose = seqs, max_len, transpose
        self.pitch_lo, self.pitch_hi = pitch_lo, pitch_hi
        self.items = [(i, s) for i, x in enumerate(seqs) for s in range(0, max(1, len(x) - max_len), max_len // 2)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        i, s = self.items[idx]
        x = self.seqs[i][s:s + self.max_len + 1].astype(np.int64)
        if self.transpose:
            m = (x >= self.pitch_lo) & (x <= self.pitch_hi)
            if m.any():
                sh = random.randint(-self.transpose, self.transpose)
                if self.pitch_lo <= x[m].min() + sh and x[m].max() + sh <= self.pitch_hi:
                    x[m] += sh
        out = np.zeros(self.max_len + 1, dtype=np.int64)
        out[:len(x)] = x
        return torch.from_numpy(out)


class RelativeSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, max_len):
        super().__init__()
        self.n_head, self.d_k, self.max_len = n_head, d_model // n_head, max_len
        self.q, self.k, self.v = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.fc = nn.Linear(d_model, d_model)
        self.rel_emb = nn.Parameter(torch.randn(max_len, self.d_k) / math.sqrt(self.d_k))

    def forward(self, x):
        B, L, D = x.shape
        q = self.q(x).view(B, L, self.n_head, self.d_k).transpose(1, 2)
        k = self.k(x).view(B, L, self.n_head, self.d_k).transpose(1, 2)
        v = self.v(x).view(B, L, self.n_head, self.d_k).transpose(1, 2)
        qr = q @ self.rel_emb[-L:].T
        s_rel = F.pad(qr, (1, 0)).view(B, self.n_head, L + 1, L)[:, :, 1:, :]
        scores = (q @ k.transpose(-1, -2) + s_rel) / math.sqrt(self.d_k)
        scores = scores.masked_fill(torch.triu(torch.ones(L, L, device=x.device), 1).bool(), float("-inf"))
        return self.fc((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D))


class JazzTransformer(nn.Module):
    def __init__(self, vocab, d_model, n_layer, n_head, max_len, dropout=0.1):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(vocab, d_model)
        self.attn = nn.ModuleList(RelativeSelfAttention(d_model, n_head, max_len) for _ in range(n_layer))
        self.ff = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
                                for _ in range(n_layer))
        self.ln_a = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layer))
        self.ln_f = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layer))
        self.drop = nn.Dropout(dropout)
        self.out_ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x):
        h = self.drop(self.embed(x))
        for attn, ff, la, lf in zip(self.attn, self.ff, self.ln_a, self.ln_f):
            h = h + self.drop(attn(la(h)))
            h = h + self.drop(ff(lf(h)))
        return self.out(self.out_ln(h))


def tokenize_folder(tok, folder):
    seqs = []
    for f in sorted(glob(os.path.join(folder, "**", "*.mid"), recursive=True)):
        try:
            s = tok.encode(Score(f))
        except Exception:
            continue
        s = s[0] if isinstance(s, list) else s
        if len(s.ids) > 100:
            seqs.append(np.asarray([tok["BOS_None"], *s.ids, tok["EOS_None"]], dtype=np.int32))
    return seqs


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    if rank != 0:
        log.setLevel(logging.WARNING)

    tok = REMI(TokenizerConfig(use_chords=True, use_tempos=True, num_velocities=16, use_rests=True,
                               special_tokens=["PAD", "BOS", "EOS"]))
    pitch = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    seqs = tokenize_folder(tok, args.wjazzd) + tokenize_folder(tok, args.pijama)
    val_ids = set(range(0, len(seqs), 15))
    train = JazzSet([s for i, s in enumerate(seqs) if i not in val_ids], args.max_len, pitch[0], pitch[-1], args.transpose)
    val = JazzSet([s for i, s in enumerate(seqs) if i in val_ids], args.max_len, pitch[0], pitch[-1])
    log.info("train windows %d, val windows %d", len(train), len(val))

    train_sampler = DistributedSampler(train)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=args.batch_size, num_workers=2)

    model = JazzTransformer(len(tok.vocab), args.d_model, args.n_layer, args.n_head, args.max_len).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * math.sqrt(world))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    is_pitch = torch.zeros(len(tok.vocab), dtype=torch.bool, device=device)
    is_pitch[pitch] = True
    os.makedirs(args.save_dir, exist_ok=True)

    best = 1e9
    for epoch in range(args.n_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, seq in enumerate(train_loader):
            seq = seq.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), seq[:, 1:].reshape(-1), ignore_index=0)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
        scheduler.step()

        net = model.module
        net.eval()
        acc = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for seq in val_loader:
                seq = seq.to(device)
                y = seq[:, 1:]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    lg = net(seq[:, :-1]).float()
                acc[0] += F.cross_entropy(lg.transpose(1, 2), y, ignore_index=0, reduction="sum")
                acc[1] += (y != 0).sum()
                acc[2] += ((lg.argmax(-1) == y) & is_pitch[y]).sum()
                acc[3] += is_pitch[y].sum()
        dist.all_reduce(acc)
        val_ppl = math.exp(acc[0] / acc[1])
        log.info("epoch %d val ppl %.3f note acc %.4f", epoch, val_ppl, acc[2] / acc[3])

        if rank == 0:
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.save_dir, "last.pt"))
            if val_ppl < best:
                best = val_ppl
                torch.save({"epoch": epoch, "model": net.state_dict()}, os.path.join(args.save_dir, "best.pt"))
            if epoch % 10 == 0:
                seq = torch.tensor([[tok["BOS_None"]]], device=device)
                with torch.no_grad():
                    for _ in range(1024):
                        p = net(seq[:, -args.max_len:])[0, -1].div(1.1).softmax(-1)
                        seq = torch.cat([seq, torch.multinomial(p, 1)[None]], 1)
                tok.decode([seq[0].tolist()]).dump_midi(os.path.join(args.save_dir, f"sample_{epoch}.mid"))
        net.train()
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
