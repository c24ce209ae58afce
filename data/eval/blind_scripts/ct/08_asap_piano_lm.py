"""Piano performance LM on ASAP (REMI with chords), with note-level validation metrics.

torchrun --nproc_per_node=4 08_asap_piano_lm.py --asap_dir data/asap-dataset --run_name asap_remi_base
"""
import argparse
import math
import os
import zlib

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from miditok import REMI, TokenizerConfig
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--asap_dir", default="data/asap-dataset")
    ap.add_argument("--ckpt_dir", default="checkpoints")
    ap.add_argument("--run_name", default="asap_remi")
    ap.add_argument("--seq_len", type=int, default=768)
    ap.add_argument("--d_model", type=int, default=384)
    ap.add_argument("--n_layers", type=int, default=8)
    ap.add_argument("--n_heads", type=int, default=6)
    ap.add_argument("--global_batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--transpose", type=int, default=6)
    return ap.parse_args()


class TokenTypes:
    def __init__(self, tok):
        n = len(tok.vocab)
        self.kind = np.zeros(n, dtype=np.int64)   # 0 other, 1 pitch, 2 position, 3 duration
        for t, i in tok.vocab.items():
            if t.startswith("Pitch_"):
                self.kind[i] = 1
            elif t.startswith("Position_"):
                self.kind[i] = 2
            elif t.startswith("Duration_"):
                self.kind[i] = 3
        self.pitch_ids = np.where(self.kind == 1)[0]


class ASAPWindows(Dataset):
    def __init__(self, seqs, seq_len, types, transpose):
        self.seqs, self.seq_len, self.types, self.transpose = seqs, seq_len, types, transpose
        self.index = []
        for i, s in enumerate(seqs):
            n_win = max(1, math.ceil((len(s) - 1) / seq_len))
            self.index += [(i, j * seq_len) for j in range(n_win)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, st = self.index[k]
        w = self.seqs[i][st:st + self.seq_len + 1].astype(np.int64)
        if self.transpose:
            pm = self.types.kind[w] == 1
            if pm.any():
                lo, hi = self.types.pitch_ids[0], self.types.pitch_ids[-1]
                d = np.random.randint(max(-self.transpose, lo - w[pm].min()), min(self.transpose, hi - w[pm].max()) + 1)
                w[pm] += d
        x = np.zeros(self.seq_len + 1, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x)


class RelativeAttention(nn.Module):
    """Music Transformer relative attention with the memory-efficient skewing trick."""

    def __init__(self, d, h, max_len, p):
        super().__init__()
        self.h, self.dh, self.max_len = h, d // h, max_len
        self.in_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.rel = nn.Parameter(torch.zeros(h, max_len, self.dh))
        nn.init.normal_(self.rel, std=0.02)
        self.p = p

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.in_proj(x).view(b, l, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        qe = torch.einsum("bhid,hjd->bhij", q, self.rel[:, self.max_len - l:])
        qe = F.pad(qe, (1, 0)).view(b, self.h, l + 1, l)[:, :, 1:]
        causal = torch.ones(l, l, device=x.device, dtype=torch.bool).tril()
        bias = qe / math.sqrt(self.dh)
        bias = bias.masked_fill(~causal, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype),
                                           dropout_p=self.p if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(b, l, d))


class Layer(nn.Module):
    def __init__(self, d, h, max_len, p):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.att = RelativeAttention(d, h, max_len, p)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop(self.att(self.n1(x)))
        return x + self.drop(self.ff(self.n2(x)))


class PianoLM(nn.Module):
    def __init__(self, vocab, d, n_layers, h, max_len, p=0.1):
        super().__init__()
        self.max_len = max_len
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.layers = nn.ModuleList(Layer(d, h, max_len, p) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))

    @torch.no_grad()
    def continue_sequence(self, prompt, n, temperature=1.0, top_p=0.92):
        seq = prompt
        for _ in range(n):
            logits = self(seq[:, -self.max_len:])[:, -1].float() / temperature
            p, i = logits.softmax(-1).sort(descending=True)
            p[p.cumsum(-1) - p > top_p] = 0
            seq = torch.cat([seq, i.gather(1, torch.multinomial(p, 1))], 1)
        return seq


@torch.no_grad()
def validate(model, loader, device, kind):
    model.eval()
    nll, n_tok = 0.0, 0
    hits = torch.zeros(4, device=device)
    counts = torch.zeros(4, device=device)
    for seq in loader:
        seq = seq.to(device)
        x, y = seq[:, :-1], seq[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).float()
        nll += F.cross_entropy(logits.transpose(1, 2), y, ignore_index=0, reduction="sum").item()
        n_tok += (y != 0).sum().item()
        pred = logits.argmax(-1)
        k = kind[y]
        for t in (1, 2, 3):
            m = (k == t) & (y != 0)
            hits[t] += (pred[m] == y[m]).sum()
            counts[t] += m.sum()
    model.train()
    acc = (hits / counts.clamp(min=1)).tolist()
    return {"val/ppl": math.exp(nll / n_tok), "val/pitch_acc": acc[1], "val/position_acc": acc[2],
            "val/duration_acc": acc[3]}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    per_gpu = args.global_batch // world

    tok = REMI(TokenizerConfig(num_velocities=32, use_chords=True, use_tempos=True, use_sustain_pedals=True,
                               special_tokens=["PAD", "BOS", "EOS"]))
    types = TokenTypes(tok)
    meta = pd.read_csv(os.path.join(args.asap_dir, "metadata.csv"))
    perfs = sorted(meta.midi_performance.unique())
    # a piece (all its performances) goes to validation if its title hashes into the 10% bucket
    piece_of = dict(zip(meta.midi_performance, meta.title))
    is_val = {p: zlib.crc32(piece_of[p].encode()) % 10 == 0 for p in perfs}
    seqs = {"train": [], "val": []}
    for p in perfs:
        s = tok.encode(os.path.join(args.asap_dir, p))
        s = s[0] if isinstance(s, list) else s
        seqs["val" if is_val[p] else "train"].append(np.array([tok["BOS_None"], *s.ids, tok["EOS_None"]], np.int32))

    train_ds = ASAPWindows(seqs["train"], args.seq_len, types, args.transpose)
    val_ds = ASAPWindows(seqs["val"], args.seq_len, types, 0)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, per_gpu, sampler=train_sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, per_gpu, sampler=val_sampler, num_workers=2, pin_memory=True)

    model = PianoLM(len(tok.vocab), args.d_model, args.n_layers, args.n_heads, args.seq_len).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps, pct_start=0.04,
                                                anneal_strategy="cos")
    kind = torch.from_numpy(types.kind).to(device)

    if rank == 0:
        wandb.init(project="asap-music-lm", name=args.run_name, config=vars(args))
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best_ppl = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, seq in enumerate(train_dl):
            seq = seq.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]})

        metrics = validate(model, val_dl, device, kind)
        if rank == 0:
            wandb.log({**metrics, "epoch": epoch})
            print(f"epoch {epoch}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            if metrics["val/ppl"] < best_ppl:
                best_ppl = metrics["val/ppl"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                           os.path.join(args.ckpt_dir, f"{args.run_name}_best.pt"))
            if epoch % 10 == 0:
                prompt = val_ds[0][:256].unsqueeze(0).to(device)
                model.module.eval()
                out = model.module.continue_sequence(prompt, 768)
                model.module.train()
                path = os.path.join(args.ckpt_dir, f"{args.run_name}_ep{epoch}.mid")
                tok.decode([out[0].tolist()]).dump_midi(path)
                wandb.save(path)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
