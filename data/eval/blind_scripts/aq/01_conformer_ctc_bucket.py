#!/usr/bin/env python
"""Conformer-CTC training on LibriSpeech-style JSON-lines manifests.

    torchrun --nproc_per_node=8 01_conformer_ctc_bucket.py \
        --train-manifest data/train_960.jsonl --valid-manifest data/dev_clean.jsonl \
        --spm-model data/spm_bpe256.model
"""
import argparse
import json
import math
import os
import random
import time

import jiwer
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import Conformer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--valid-manifest", required=True)
    p.add_argument("--spm-model", required=True)
    p.add_argument("--exp-dir", default="exp/conformer_ctc")
    p.add_argument("--max-duration", type=float, default=200.0, help="seconds of audio per batch")
    p.add_argument("--max-utt-duration", type=float, default=20.0)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=15000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class ManifestDataset(Dataset):
    def __init__(self, manifest, sp, max_dur=None):
        self.items = []
        with open(manifest) as f:
            for line in f:
                ex = json.loads(line)
                if max_dur is not None and ex["duration"] > max_dur:
                    continue
                self.items.append(ex)
        self.sp = sp
        self.durations = [ex["duration"] for ex in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        ex = self.items[idx]
        wav, sr = torchaudio.load(ex["audio_filepath"])
        if sr != 16000:
            wav = torchaudio.functional.resample(wav, sr, 16000)
        tokens = self.sp.encode(ex["text"].lower())
        return wav[0], torch.tensor(tokens, dtype=torch.long), ex["text"]


def collate(batch):
    wavs, toks, texts = zip(*batch)
    wav_lens = torch.tensor([w.numel() for w in wavs])
    tok_lens = torch.tensor([t.numel() for t in toks])
    wavs = nn.utils.rnn.pad_sequence(wavs, batch_first=True)
    toks = nn.utils.rnn.pad_sequence(toks, batch_first=True)
    return wavs, wav_lens, toks, tok_lens, list(texts)


class DurationBucketSampler(Sampler):
    """Sorts utterances by length and packs them into batches of ~max_duration seconds."""

    def __init__(self, durations, max_duration, shuffle=True, seed=0):
        self.durations = durations
        self.max_duration = max_duration
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.batches = self._pack()

    def _pack(self):
        order = sorted(range(len(self.durations)), key=lambda i: self.durations[i])
        batches, cur, cur_max = [], [], 0.0
        for idx in order:
            d = self.durations[idx]
            if cur and max(cur_max, d) * (len(cur) + 1) > self.max_duration:
                batches.append(cur)
                cur, cur_max = [], 0.0
            cur.append(idx)
            cur_max = max(cur_max, d)
        if cur:
            batches.append(cur)
        return batches

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        batches = list(self.batches)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(batches)
        return iter(batches)

    def __len__(self):
        return len(self.batches)


class FeatureFrontend(nn.Module):
    """80-dim log-mel + utterance CMVN + SpecAugment, computed on the GPU."""

    def __init__(self, n_mels=80):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=16000, n_fft=400, win_length=400, hop_length=160, n_mels=n_mels)
        self.freq_mask = torchaudio.transforms.FrequencyMasking(27)
        self.time_mask = torchaudio.transforms.TimeMasking(100, p=0.05)

    @torch.no_grad()
    def forward(self, wavs, wav_lens, specaug=False):
        feats = (self.mel(wavs) + 1e-6).log()  # B, F, T
        feat_lens = wav_lens // 160 + 1
        mean = feats.mean(dim=-1, keepdim=True)
        std = feats.std(dim=-1, keepdim=True)
        feats = (feats - mean) / (std + 1e-5)
        if specaug:
            for _ in range(2):
                feats = self.freq_mask(feats)
            for _ in range(5):
                feats = self.time_mask(feats)
        return feats.transpose(1, 2), feat_lens


class ConformerCTC(nn.Module):
    def __init__(self, vocab_size, n_mels=80, d_model=256, num_layers=16, num_heads=4):
        super().__init__()
        self.subsample = nn.Sequential(
            nn.Conv2d(1, d_model, 3, stride=2), nn.ReLU(),
            nn.Conv2d(d_model, d_model, 3, stride=2), nn.ReLU(),
        )
        f_out = ((n_mels - 1) // 2 - 1) // 2
        self.proj = nn.Linear(d_model * f_out, d_model)
        self.encoder = Conformer(input_dim=d_model, num_heads=num_heads, ffn_dim=4 * d_model,
                                 num_layers=num_layers, depthwise_conv_kernel_size=31, dropout=0.1)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, feats, feat_lens):
        x = self.subsample(feats.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, t, c * f))
        lens = (((feat_lens - 1) // 2 - 1) // 2).clamp(min=1, max=t)
        x, lens = self.encoder(x, lens)
        return self.head(x), lens


def noam_lambda(d_model, warmup):
    def fn(step):
        step = max(step, 1)
        return (d_model ** -0.5) * min(step ** -0.5, step * warmup ** -1.5) * (warmup ** 0.5) * (d_model ** 0.5)
    return fn


def greedy_decode(log_probs, lens, sp, blank):
    hyps = []
    pred = log_probs.argmax(-1).cpu()
    for p, n in zip(pred, lens.cpu()):
        p = torch.unique_consecutive(p[:n])
        p = [int(t) for t in p if t != blank]
        hyps.append(sp.decode(p))
    return hyps


@torch.no_grad()
def evaluate(model, frontend, loader, sp, blank, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, errors, ref_words
    for wavs, wav_lens, toks, tok_lens, texts in loader:
        wavs, wav_lens = wavs.to(device), wav_lens.to(device)
        toks, tok_lens = toks.to(device), tok_lens.to(device)
        feats, feat_lens = frontend(wavs, wav_lens)
        logits, out_lens = model(feats, feat_lens)
        lp = logits.log_softmax(-1)
        loss = F.ctc_loss(lp.transpose(0, 1), toks, out_lens, tok_lens, blank=blank,
                          reduction="sum", zero_infinity=True)
        hyps = greedy_decode(lp, out_lens, sp, blank)
        for ref, hyp in zip(texts, hyps):
            out = jiwer.process_words(ref.lower(), hyp)
            stats[1] += out.substitutions + out.deletions + out.insertions
            stats[2] += len(ref.split())
        stats[0] += loss
    dist.all_reduce(stats)
    model.train()
    return stats[0].item() / max(stats[2].item(), 1), stats[1].item() / max(stats[2].item(), 1)


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=args.spm_model)
    blank = sp.get_piece_size()
    vocab_size = blank + 1

    train_ds = ManifestDataset(args.train_manifest, sp, max_dur=args.max_utt_duration)
    valid_ds = ManifestDataset(args.valid_manifest, sp)
    train_sampler = DurationBucketSampler(train_ds.durations, args.max_duration, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, persistent_workers=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    valid_loader = DataLoader(valid_ds, batch_size=16, sampler=valid_sampler, collate_fn=collate,
                              num_workers=2)

    frontend = FeatureFrontend().to(device)
    model = ConformerCTC(vocab_size, d_model=args.d_model, num_layers=args.num_layers).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda(args.d_model, args.warmup_steps))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    os.makedirs(args.exp_dir, exist_ok=True)
    if rank == 0:
        print(f"world_size={world_size} train_utts={len(train_ds)} batches/epoch={len(train_sampler)}")

    best_wer = math.inf
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wavs, wav_lens, toks, tok_lens, _ in train_loader:
            wavs, wav_lens = wavs.to(device, non_blocking=True), wav_lens.to(device)
            toks, tok_lens = toks.to(device, non_blocking=True), tok_lens.to(device)
            feats, feat_lens = frontend(wavs, wav_lens, specaug=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits, out_lens = model(feats, feat_lens)
            lp = logits.float().log_softmax(-1)
            loss = F.ctc_loss(lp.transpose(0, 1), toks, out_lens, tok_lens, blank=blank,
                              reduction="sum", zero_infinity=True) / wavs.size(0)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s")

        valid_loss, wer = evaluate(model, frontend, valid_loader, sp, blank, device)
        if rank == 0:
            print(f"epoch {epoch} valid_loss/word {valid_loss:.3f} WER {wer * 100:.2f}")
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step}
            torch.save(ckpt, os.path.join(args.exp_dir, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(ckpt, os.path.join(args.exp_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
