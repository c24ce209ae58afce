"""Multitrack symbolic LM on the Lakh MIDI "clean" subset, MMM tokenization (miditok + symusic).

Tokenization happens on the fly in the DataLoader workers (symusic is fast enough),
with random transposition / tempo augmentation.

    torchrun --nproc_per_node=8 08_lakh_multitrack_lm.py --midi_root /data/lmd_clean
"""
import argparse
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from miditok import MMM, TokenizerConfig
from symusic import Score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM


def print0(*a, **kw):
    if dist.get_rank() == 0:
        print(*a, **kw, flush=True)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def make_tokenizer():
    cfg = TokenizerConfig(
        pitch_range=(21, 109), beat_res={(0, 4): 8, (4, 12): 4}, num_velocities=16,
        use_programs=True, use_tempos=True, use_time_signatures=True, use_rests=True,
        special_tokens=["PAD", "BOS", "EOS"], base_tokenizer="REMI",
    )
    return MMM(cfg)


class LakhDataset(Dataset):
    def __init__(self, paths, tokenizer, max_len, augment):
        self.paths = paths
        self.tok = tokenizer
        self.max_len = max_len
        self.augment = augment
        self.pad = tokenizer.pad_token_id
        self.bos = tokenizer["BOS_None"]
        self.eos = tokenizer["EOS_None"]

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        try:
            score = Score(str(self.paths[i]))
            if self.augment:
                score = score.shift_pitch(random.randint(-5, 6))
            ids = self.tok.encode(score).ids
        except Exception:
            ids = []
        ids = [self.bos] + ids + [self.eos]
        if len(ids) > self.max_len + 1:
            s = random.randint(0, len(ids) - self.max_len - 1) if self.augment else 0
            ids = ids[s:s + self.max_len + 1]
        out = torch.full((self.max_len + 1,), self.pad, dtype=torch.long)
        out[:len(ids)] = torch.tensor(ids)
        return out


def build_splits(midi_root, val_frac):
    paths = sorted(Path(midi_root).rglob("*.mid"))
    random.shuffle(paths)
    n_val = max(1, int(len(paths) * val_frac))
    return paths[n_val:], paths[:n_val]


@torch.no_grad()
def evaluate(model, loader, pad_id, device, max_batches):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = batch.to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x, attention_mask=(x != pad_id)).logits
        s[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=pad_id, reduction="sum")
        s[1] += (y != pad_id).sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--midi_root", required=True)
    ap.add_argument("--out", default="runs/lakh_mmm")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--val_frac", type=float, default=0.02)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--eval_batches", type=int, default=50)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different seed per rank so that crops / transpositions differ between GPUs
    seed_everything(args.seed + rank)

    tokenizer = make_tokenizer()
    train_paths, val_paths = build_splits(args.midi_root, args.val_frac)
    print0(f"{len(train_paths)} train files, {len(val_paths)} val files, vocab {len(tokenizer)}")

    train_ds = LakhDataset(train_paths, tokenizer, args.max_len, augment=True)
    val_ds = LakhDataset(val_paths[rank::world], tokenizer, args.max_len, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, num_workers=4)

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=args.max_len,
        rope_theta=10000.0, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer["BOS_None"],
        eos_token_id=tokenizer["EOS_None"], attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    updates = args.epochs * (len(train_dl) // args.accum)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / updates))))
    pad = tokenizer.pad_token_id

    os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, batch in enumerate(train_dl):
            batch = batch.to(device, non_blocking=True)
            x, y = batch[:, :-1], batch[:, 1:].clone()
            y[y == pad] = -100
            sync_now = (it + 1) % args.accum == 0
            ctx = model.no_sync() if not sync_now else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(input_ids=x, attention_mask=(x != pad)).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
                (loss / args.accum).backward()
            if not sync_now:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                print0(f"epoch {epoch} step {step}/{updates} loss {loss.item():.4f}")
            if step % 2000 == 0:
                v = evaluate(model.module, val_dl, pad, device, args.eval_batches)
                print0(f"step {step} val loss {v:.4f} ppl {math.exp(v):.2f}")
                if rank == 0:
                    model.module.save_pretrained(os.path.join(args.out, f"step{step}"))
                    tokenizer.save(os.path.join(args.out, f"step{step}", "tokenizer.json"))
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tokenizer.save(os.path.join(args.out, "final", "tokenizer.json"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
