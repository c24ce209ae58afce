#!/usr/bin/env python3
"""Train a MusicGen-style codebook LM on raw music, tokenised on the fly with a frozen EnCodec.

We keep the audio on disk as wav/flac and let a frozen 32 kHz EnCodec produce the
4 codebook streams per batch, so we can change crop length without re-tokenising
the catalogue. Codebooks are interleaved with the MusicGen delay pattern.
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import EncodecModel


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--valid-manifest", required=True)
    p.add_argument("--out-dir", default="runs/musiclm_small")
    p.add_argument("--codec", default="facebook/encodec_32khz")
    p.add_argument("--segment-seconds", type=float, default=15.0)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--save-every", type=int, default=5000)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class MusicCrops(Dataset):
    """Random fixed-length mono crops from a tsv manifest of `path<TAB>num_frames<TAB>sr`."""

    def __init__(self, manifest, sample_rate, segment_seconds, random_crop=True):
        self.items = []
        with open(manifest) as f:
            for line in f:
                path, n, sr = line.rstrip("\n").split("\t")
                self.items.append((path, int(n), int(sr)))
        self.sample_rate = sample_rate
        self.segment = int(segment_seconds * sample_rate)
        self.random_crop = random_crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        path, n, sr = self.items[idx]
        seg_src = int(self.segment * sr / self.sample_rate)
        offset = random.randint(0, max(0, n - seg_src)) if self.random_crop else 0
        wav, sr = torchaudio.load(path, frame_offset=offset, num_frames=seg_src)
        wav = wav.mean(0, keepdim=True)
        if sr != self.sample_rate:
            wav = torchaudio.functional.resample(wav, sr, self.sample_rate)
        if wav.shape[-1] < self.segment:
            wav = F.pad(wav, (0, self.segment - wav.shape[-1]))
        return wav[:, : self.segment]


class AudioTokenizer:
    """Frozen EnCodec wrapper: waveform [B, 1, T] -> codes [B, K, frames]."""

    def __init__(self, name, device="cuda:0"):
        self.device = torch.device(device)
        self.model = EncodecModel.from_pretrained(name).to(self.device).eval()
        self.model.requires_grad_(False)
        self.sample_rate = self.model.config.sampling_rate
        self.bandwidth = self.model.config.target_bandwidths[-1]

    @torch.no_grad()
    def encode(self, wav):
        out = self.model.encode(wav.to(self.device), bandwidth=self.bandwidth)
        return out.audio_codes[0]  # single chunk -> [B, K, frames]


def apply_delay(codes, special):
    b, k, t = codes.shape
    out = codes.new_full((b, k, t + k - 1), special)
    for q in range(k):
        out[:, q, q : q + t] = codes[:, q]
    return out


class CodebookLM(nn.Module):
    def __init__(self, n_q, card, dim, heads, layers, max_len):
        super().__init__()
        self.n_q, self.card = n_q, card
        self.emb = nn.ModuleList([nn.Embedding(card + 1, dim) for _ in range(n_q)])
        self.pos = nn.Embedding(max_len, dim)
        block = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
        )
        self.transformer = nn.TransformerEncoder(block, layers)
        self.norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleList([nn.Linear(dim, card) for _ in range(n_q)])

    def forward(self, codes):
        t = codes.shape[-1]
        x = sum(self.emb[q](codes[:, q]) for q in range(self.n_q))
        x = x + self.pos(torch.arange(t, device=codes.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=codes.device)
        x = self.norm(self.transformer(x, mask=mask, is_causal=True))
        return torch.stack([head(x) for head in self.heads], dim=1)  # [B, K, T, card]


def lm_loss(model, codes, card):
    delayed = apply_delay(codes, special=card)
    bos = delayed.new_full(delayed[..., :1].shape, card)
    inp = torch.cat([bos, delayed[..., :-1]], dim=-1)
    logits = model(inp)
    return F.cross_entropy(logits.flatten(0, 2).float(), delayed.flatten(), ignore_index=card)


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model, loader, tokenizer, card, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for wav in loader:
        codes = tokenizer.encode(wav).to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(model, codes, card)
        total[0] += loss.float() * codes.shape[0]
        total[1] += codes.shape[0]
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    out_dir = Path(args.out_dir)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)
    writer = SummaryWriter(out_dir / "tb") if is_main else None

    tokenizer = AudioTokenizer(args.codec)
    n_q = tokenizer.model.config.num_quantizers
    card = tokenizer.model.config.codebook_size
    frame_rate = tokenizer.model.config.frame_rate
    max_len = int(args.segment_seconds * frame_rate) + n_q + 1

    per_gpu_batch = args.batch_size // world_size
    train_set = MusicCrops(args.train_manifest, tokenizer.sample_rate, args.segment_seconds)
    valid_set = MusicCrops(args.valid_manifest, tokenizer.sample_rate, args.segment_seconds, random_crop=False)
    valid_set = Subset(valid_set, list(range(rank, len(valid_set), world_size)))
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=per_gpu_batch, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    valid_loader = DataLoader(valid_set, batch_size=per_gpu_batch, num_workers=4, pin_memory=True)

    model = CodebookLM(n_q, card, args.dim, args.heads, args.layers, max_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.max_steps)
    )

    step, epoch = 0, 0
    ckpt_path = out_dir / "last.pt"
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, epoch = state["step"], state["epoch"]
        if is_main:
            print(f"resumed from step {step}")

    model.train()
    t0 = time.time()
    running = torch.zeros(1, device=device)
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for wav in train_loader:
            codes = tokenizer.encode(wav).to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(model, codes, card)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            running += loss.detach()

            if step % args.log_every == 0:
                dist.all_reduce(running)
                avg = running.item() / (args.log_every * world_size)
                running.zero_()
                if is_main:
                    dt = (time.time() - t0) / args.log_every
                    print(f"step {step} loss {avg:.4f} ppl {math.exp(avg):.1f} {dt:.2f}s/it")
                    writer.add_scalar("train/loss", avg, step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                t0 = time.time()

            if step % args.eval_every == 0:
                val = evaluate(model.module, valid_loader, tokenizer, card, device)
                if is_main:
                    print(f"step {step} valid loss {val:.4f}")
                    writer.add_scalar("valid/loss", val, step)

            if step % args.save_every == 0:
                if is_main:
                    torch.save({
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "step": step,
                        "epoch": epoch,
                    }, ckpt_path)
                dist.barrier()

            if step >= args.max_steps:
                break
        epoch += 1

    if is_main:
        torch.save(model.module.state_dict(), out_dir / "final_lm.pt")
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
