"""GPT-NeoX style LM (rotary positions) on MAESTRO v3 REMI tokens, with note-level validation metrics.

torchrun --nproc_per_node=4 14_maestro_remi_lm.py --maestro data/maestro-v3.0.0 --workdir runs/neox_maestro
"""
import argparse
import contextlib
import csv
import math
import os
import pickle
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from miditok import REMI, TokenizerConfig
from symusic import Score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, get_cosine_schedule_with_warmup


class MetricTracker:
    """Sums per-token statistics over an evaluation pass; sync() adds up the sums of all ranks."""

    def __init__(self):
        self.sums = defaultdict(float)

    def add(self, **kw):
        for k, v in kw.items():
            self.sums[k] += float(v)

    def sync(self):
        keys = sorted(self.sums)
        t = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        self.sums = defaultdict(float, zip(keys, t.tolist()))
        return self

    def summary(self):
        s = self.sums
        return {
            "nll": s["nll"] / s["tokens"],
            "ppl": math.exp(s["nll"] / s["tokens"]),
            "token_acc": s["correct"] / s["tokens"],
            "pitch_acc": s["pitch_correct"] / max(s["pitch_total"], 1),
            "duration_acc": s["dur_correct"] / max(s["dur_total"], 1),
        }


class MaestroWindows(Dataset):
    def __init__(self, seqs, seq_len, pad_id, pitch_ids=None, shift=0):
        self.seqs, self.seq_len, self.pad_id, self.shift = seqs, seq_len, pad_id, shift
        self.lo, self.hi = (pitch_ids[0], pitch_ids[-1]) if pitch_ids else (0, 0)
        self.windows = [(i, s) for i, q in enumerate(seqs) for s in range(0, max(1, len(q) - seq_len), seq_len * 3 // 4)]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, k):
        i, s = self.windows[k]
        w = np.array(self.seqs[i][s:s + self.seq_len], dtype=np.int64)
        if self.shift:
            m = (w >= self.lo) & (w <= self.hi)
            if m.any():
                t = np.random.randint(-self.shift, self.shift + 1)
                if self.lo <= w[m].min() + t and w[m].max() + t <= self.hi:
                    w[m] += t
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        ids[:len(w)] = w
        return torch.from_numpy(ids)


def tokenize_maestro(root, tok):
    split = {"train": [], "validation": [], "test": []}
    with open(os.path.join(root, "maestro-v3.0.0.csv")) as f:
        for row in csv.DictReader(f):
            seq = tok.encode(Score(os.path.join(root, row["midi_filename"])))
            seq = seq[0] if isinstance(seq, list) else seq
            split[row["split"]].append(np.asarray([tok["BOS_None"], *seq.ids, tok["EOS_None"]], dtype=np.int32))
    return split


@torch.no_grad()
def evaluate(model, loader, device, pad_id, is_pitch, is_dur):
    model.eval()
    m = MetricTracker()
    for ids in loader:
        ids = ids.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=(ids != pad_id).long()).logits[:, :-1].float()
        y = ids[:, 1:]
        valid = y != pad_id
        pred = logits.argmax(-1)
        hit = (pred == y) & valid
        m.add(nll=F.cross_entropy(logits.transpose(1, 2), y, ignore_index=pad_id, reduction="sum"),
              tokens=valid.sum(), correct=hit.sum(),
              pitch_correct=(hit & is_pitch[y]).sum(), pitch_total=(valid & is_pitch[y]).sum(),
              dur_correct=(hit & is_dur[y]).sum(), dur_total=(valid & is_dur[y]).sum())
    model.train()
    return m.sync().summary()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--maestro", default="data/maestro-v3.0.0")
    ap.add_argument("--workdir", default="runs/neox_maestro")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--warmup_ratio", type=float, default=0.02)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    tok = REMI(TokenizerConfig(num_velocities=32, use_tempos=True, use_sustain_pedals=True,
                               special_tokens=["PAD", "BOS", "EOS"]))
    pad_id = tok["PAD_None"]
    cache = os.path.join(args.workdir, "maestro_remi.pkl")
    if rank == 0:
        os.makedirs(args.workdir, exist_ok=True)
        if not os.path.exists(cache):
            with open(cache + ".part", "wb") as f:
                pickle.dump(tokenize_maestro(args.maestro, tok), f)
            os.rename(cache + ".part", cache)
    dist.barrier()
    with open(cache, "rb") as f:
        data = pickle.load(f)

    pitch_ids = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    is_pitch = torch.zeros(len(tok.vocab), dtype=torch.bool, device=device)
    is_pitch[pitch_ids] = True
    is_dur = torch.tensor([t.startswith("Duration_") for t in sorted(tok.vocab, key=tok.vocab.get)], device=device)
    train_ds = MaestroWindows(data["train"], args.seq_len, pad_id, pitch_ids, shift=5)
    val_ds = MaestroWindows(data["validation"], args.seq_len, pad_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=2, pin_memory=True)

    cfg = GPTNeoXConfig(vocab_size=len(tok.vocab), hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=args.seq_len, rotary_pct=0.25,
                        use_parallel_residual=True, bos_token_id=tok["BOS_None"], eos_token_id=tok["EOS_None"])
    model = DDP(GPTNeoXForCausalLM(cfg).to(device), device_ids=[local_rank])
    # lr was tuned for a global batch of 32 windows
    lr = args.lr * math.sqrt(world * args.batch_size * args.grad_accum / 32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    updates = args.epochs * len(train_dl) // args.grad_accum
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup_ratio * updates), updates)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, ids in enumerate(train_dl):
            ids = ids.to(device, non_blocking=True)
            labels = ids.masked_fill(ids == pad_id, -100)
            sync = (i + 1) % args.grad_accum == 0
            with model.no_sync() if not sync else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(input_ids=ids, attention_mask=(ids != pad_id).long(), labels=labels)
                (out.loss / args.grad_accum).backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} it {i} loss {out.loss.item():.4f}", flush=True)

        metrics = evaluate(model, val_dl, device, pad_id, is_pitch, is_dur)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
            model.module.save_pretrained(os.path.join(args.workdir, "last"))
            if metrics["ppl"] < best:
                best = metrics["ppl"]
                model.module.save_pretrained(os.path.join(args.workdir, "best"))
            if epoch % 5 == 0:
                gen = model.module.generate(torch.tensor([[tok["BOS_None"]]], device=device), do_sample=True,
                                            max_new_tokens=1024, top_p=0.95, pad_token_id=pad_id)
                tok.decode([gen[0].tolist()]).dump_midi(os.path.join(args.workdir, f"sample_{epoch:03d}.mid"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
