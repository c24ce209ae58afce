#!/usr/bin/env python
"""Pretrain a GPT-2 decoder on REMI-tokenized MIDI (Lakh MIDI, miditok).

    torchrun --nproc_per_node=8 01_remi_gpt2_pretrain.py \
        --midi_dir /data/lmd_full --cache_dir /data/cache/remi --out runs/remi_gpt2
"""
import argparse
import glob
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from miditok import REMI, TokenizerConfig
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--midi_dir", required=True)
    p.add_argument("--cache_dir", default="cache/remi")
    p.add_argument("--out", default="runs/remi_gpt2")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=8, help="per GPU")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--val_every_n_files", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def build_tokenizer():
    config = TokenizerConfig(
        num_velocities=16,
        use_chords=True,
        use_tempos=True,
        use_programs=True,
        beat_res={(0, 4): 8, (4, 12): 4},
        special_tokens=["PAD", "BOS", "EOS"],
    )
    return REMI(config)


def tokenize_files(tokenizer, paths, min_len=64):
    seqs = []
    for path in tqdm(paths, desc="tokenizing", mininterval=30):
        try:
            toks = tokenizer.encode(Path(path))
        except Exception:
            # corrupted / unsupported files are common in LMD
            continue
        ids = toks[0].ids if isinstance(toks, list) else toks.ids
        if len(ids) >= min_len:
            seqs.append(ids)
    return seqs


def load_or_tokenize(tokenizer, paths, cache_dir, split):
    cache_file = os.path.join(cache_dir, f"{split}_remi.pt")
    if os.path.exists(cache_file):
        return torch.load(cache_file)
    seqs = tokenize_files(tokenizer, paths)
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(seqs, cache_file)
    return seqs


class RandomChunkDataset(Dataset):
    """One item per song; a random window of seq_len+1 tokens is cut each time."""

    def __init__(self, seqs, seq_len, bos_id, eos_id, pad_id, random_crop=True):
        self.seqs = seqs
        self.seq_len = seq_len
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.random_crop = random_crop

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, idx):
        ids = [self.bos_id] + self.seqs[idx] + [self.eos_id]
        n = self.seq_len + 1
        if len(ids) > n:
            start = random.randint(0, len(ids) - n) if self.random_crop else 0
            ids = ids[start:start + n]
        x = torch.full((n,), self.pad_id, dtype=torch.long)
        x[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        return x


def make_labels(batch, pad_id):
    inputs = batch[:, :-1].contiguous()
    labels = batch[:, 1:].clone()
    labels[labels == pad_id] = -100
    attn = (inputs != pad_id).long()
    return inputs, labels, attn


@torch.no_grad()
def evaluate(model, loader, device, pad_id):
    model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        inputs, labels, attn = make_labels(batch, pad_id)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inputs, attention_mask=attn).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), labels.view(-1),
            ignore_index=-100, reduction="sum")
        stats[0] += loss
        stats[1] += (labels != -100).sum()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = build_tokenizer()
    pad_id = tokenizer.pad_token_id
    bos_id, eos_id = tokenizer["BOS_None"], tokenizer["EOS_None"]

    midi_files = sorted(glob.glob(os.path.join(args.midi_dir, "**", "*.mid"), recursive=True))
    val_files = midi_files[:: args.val_every_n_files]
    val_set_names = set(val_files)
    train_files = [f for f in midi_files if f not in val_set_names]
    if is_main:
        print(f"{len(train_files)} train / {len(val_files)} val MIDI files, vocab={len(tokenizer)}")

    train_seqs = load_or_tokenize(tokenizer, train_files, args.cache_dir, "train")
    val_seqs = load_or_tokenize(tokenizer, val_files, args.cache_dir, "val")

    train_ds = RandomChunkDataset(train_seqs, args.seq_len, bos_id, eos_id, pad_id)
    val_ds = RandomChunkDataset(val_seqs, args.seq_len, bos_id, eos_id, pad_id, random_crop=False)
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world_size)))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False,
                            num_workers=2, pin_memory=True)

    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=args.n_embd,
        n_layer=args.n_layer, n_head=args.n_head, bos_token_id=bos_id,
        eos_token_id=eos_id, pad_token_id=pad_id,
    )
    model = GPT2LMHeadModel(config).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    decay, no_decay = [], []
    for n, p_ in model.named_parameters():
        (no_decay if p_.ndim < 2 or "ln_" in n else decay).append(p_)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    os.makedirs(args.out, exist_ok=True)
    best_val = math.inf
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            inputs, labels, attn = make_labels(batch, pad_id)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=inputs, attention_mask=attn, labels=labels)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1

            if is_main and step % args.log_every == 0:
                dt = (time.time() - t0) / args.log_every
                t0 = time.time()
                print(f"ep {epoch} step {step}/{total_steps} loss {out.loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {dt * 1000:.0f} ms/it", flush=True)

        val_loss = evaluate(model.module, val_loader, device, pad_id)
        if is_main:
            print(f"epoch {epoch}: val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
            model.module.save_pretrained(os.path.join(args.out, "last"))
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, "last", "trainer_state.pt"))
            if val_loss < best_val:
                best_val = val_loss
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_params(os.path.join(args.out, "best", "tokenizer.json"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
