"""Step-based training of a relative-position Music Transformer on GiantMIDI-Piano (REMI, miditok json tokens).
Auto-resumes from <out>/latest.pt so the job can be re-queued.

torchrun --nproc_per_node=8 11_giantmidi_music_tf.py --tokens data/giantmidi_remi_json --out runs/giantmidi_mt
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from miditok import REMI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(seq_len=1024, d_model=640, n_layer=10, n_head=10, max_rel=512, dropout=0.1,
                batch_size=8, lr=2.5e-4, warmup=3000, max_steps=300_000, log_every=50,
                eval_every=2500, ckpt_every=2500, sample_len=1500, transpose=6)


def load_tokens(folder):
    pieces = {}
    for f in sorted(Path(folder).glob("*.json")):
        with open(f) as fh:
            ids = json.load(fh)["ids"]
        ids = ids[0] if ids and isinstance(ids[0], list) else ids
        if len(ids) >= 256:
            pieces[f.stem] = np.asarray(ids, dtype=np.int32)
    return pieces


class Windows(Dataset):
    def __init__(self, pieces, seq_len, bos, eos, pad, pitch_ids=None, transpose=0):
        self.data = [np.concatenate([[bos], p, [eos]]) for p in pieces]
        self.seq_len, self.pad, self.transpose = seq_len, pad, transpose
        self.idx = [(i, s) for i, d in enumerate(self.data) for s in range(0, len(d) - seq_len // 2, seq_len // 2)]
        self.p_lo, self.p_hi = (min(pitch_ids), max(pitch_ids)) if pitch_ids else (None, None)

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i, s = self.idx[k]
        w = self.data[i][s:s + self.seq_len + 1].astype(np.int64)
        if self.transpose:
            m = (w >= self.p_lo) & (w <= self.p_hi)
            if m.any():
                t = random.randint(-self.transpose, self.transpose)
                if self.p_lo <= w[m].min() + t and w[m].max() + t <= self.p_hi:
                    w[m] += t
        out = np.full(self.seq_len + 1, self.pad, dtype=np.int64)
        out[:len(w)] = w
        return torch.from_numpy(out)


class RelBiasAttention(nn.Module):
    """Multi-head attention with a learned per-head bias for each (clipped) relative distance."""

    def __init__(self, d, h, max_rel, p):
        super().__init__()
        self.h, self.max_rel, self.p = h, max_rel, p
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.rel_bias = nn.Embedding(max_rel + 1, h)

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.h, d // self.h).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        pos = torch.arange(l, device=x.device)
        dist_ = (pos[:, None] - pos[None, :]).clamp(0, self.max_rel)
        bias = self.rel_bias(dist_).permute(2, 0, 1)
        bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf")).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.p if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(b, l, d))


class MusicTransformer(nn.Module):
    def __init__(self, vocab, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.seq_len = cfg["seq_len"]
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(cfg["n_layer"]):
            self.layers.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(d), "attn": RelBiasAttention(d, cfg["n_head"], cfg["max_rel"], cfg["dropout"]),
                "ln2": nn.LayerNorm(d), "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)),
            }))
        self.drop = nn.Dropout(cfg["dropout"])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.drop(self.emb(x))
        for blk in self.layers:
            h = h + self.drop(blk["attn"](blk["ln1"](h)))
            h = h + self.drop(blk["mlp"](blk["ln2"](h)))
        return self.head(self.ln_f(h))


@torch.no_grad()
def generate(net, start, n, top_p=0.9, temperature=1.0):
    seq = start
    for _ in range(n):
        logits = net(seq[:, -net.seq_len:])[:, -1].float() / temperature
        probs = logits.softmax(-1)
        sp, si = probs.sort(-1, descending=True)
        sp[(sp.cumsum(-1) - sp) > top_p] = 0
        seq = torch.cat([seq, si.gather(-1, torch.multinomial(sp / sp.sum(-1, keepdim=True), 1))], 1)
    return seq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", default="runs/giantmidi_mt")
    ap.add_argument("--tokenizer", default=None, help="defaults to <tokens>/tokenizer.json")
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    args = ap.parse_args()
    cfg = vars(args)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = REMI(params=args.tokenizer or os.path.join(args.tokens, "tokenizer.json"))
    pad, bos, eos = tok["PAD_None"], tok["BOS_None"], tok["EOS_None"]
    pitch_ids = [i for t, i in tok.vocab.items() if t.startswith("Pitch_")]
    pieces = load_tokens(args.tokens)
    names = sorted(pieces)
    val_names = set(names[::25])
    train_set = Windows([pieces[n] for n in names if n not in val_names], args.seq_len, bos, eos, pad,
                        pitch_ids, args.transpose)
    val_set = Windows([pieces[n] for n in names if n in val_names], args.seq_len, bos, eos, pad)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_sub = torch.utils.data.Subset(val_set, range(rank, len(val_set), world))
    val_loader = DataLoader(val_sub, args.batch_size, num_workers=2)

    model = MusicTransformer(len(tok.vocab), cfg).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    peak_lr = args.lr * world * args.batch_size / 64
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, max(0.05, 1 - s / args.max_steps)))
    scaler = torch.cuda.amp.GradScaler()

    out = Path(args.out)
    latest = out / "latest.pt"
    step, epoch, best = 0, 0, float("inf")
    if latest.exists():
        ckpt = torch.load(latest)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        step, epoch, best = ckpt["step"], ckpt["epoch"], ckpt["best"]
        if rank == 0:
            print(f"resumed from step {step}", flush=True)
    if rank == 0:
        (out / "samples").mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for seq in loader:
            seq = seq.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = ddp(seq[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=pad)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1

            if rank == 0 and step % args.log_every == 0:
                dt = (time.time() - t0) / args.log_every
                print(f"step {step} ep {epoch} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} {dt:.3f}s/it",
                      flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                model.eval()
                s = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for v in val_loader:
                        v = v.to(device)
                        with torch.autocast("cuda", dtype=torch.float16):
                            lg = model(v[:, :-1]).float()
                        s[0] += F.cross_entropy(lg.transpose(1, 2), v[:, 1:], ignore_index=pad, reduction="sum")
                        s[1] += (v[:, 1:] != pad).sum()
                dist.all_reduce(s)
                ppl = math.exp(s[0] / s[1])
                model.train()
                if rank == 0:
                    print(f"step {step} val ppl {ppl:.3f}", flush=True)
                    if ppl < best:
                        best = ppl
                        torch.save(model.state_dict(), out / "best_model.pt")
                    model.eval()
                    gen = generate(model, torch.tensor([[bos]], device=device), args.sample_len)
                    model.train()
                    tok.decode([gen[0, 1:].tolist()]).dump_midi(str(out / "samples" / f"step{step}.mid"))

            if step % args.ckpt_every == 0 and rank == 0:
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                         "scaler": scaler.state_dict(), "step": step, "epoch": epoch, "best": best, "cfg": cfg}
                torch.save(state, out / "latest.tmp")
                os.replace(out / "latest.tmp", latest)
            if step >= args.max_steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
