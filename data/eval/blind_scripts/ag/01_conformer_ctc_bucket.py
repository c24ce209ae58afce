#!/usr/bin/env python3
"""Conformer-CTC training on LibriSpeech with duration-bucketed batches.

Launch with torchrun, one process per GPU.
"""
import argparse
import json
import logging
import math
import os
import random
import time

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

import jiwer

logger = logging.getLogger("conformer_ctc")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--dev-manifest", required=True)
    p.add_argument("--bpe-model", required=True)
    p.add_argument("--exp-dir", default="exp/conformer_ctc")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds of audio per batch per GPU")
    p.add_argument("--num-epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=15000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", default="")
    return p.parse_args()


def load_manifest(path):
    items = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if d["duration"] > 20.0 or d["duration"] < 0.5:
                continue
            items.append(d)
    return items


class AsrDataset(Dataset):
    def __init__(self, items, sp):
        self.items = items
        self.sp = sp

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        d = self.items[idx]
        wav, sr = torchaudio.load(d["audio_filepath"])
        if sr != 16000:
            wav = torchaudio.functional.resample(wav, sr, 16000)
        feats = torchaudio.compliance.kaldi.fbank(wav * 32768, num_mel_bins=80, dither=1.0)
        tokens = torch.tensor(self.sp.encode(d["text"].lower()), dtype=torch.long)
        return feats, tokens, d["text"]


def collate(batch):
    feats, tokens, texts = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats])
    tok_lens = torch.tensor([t.size(0) for t in tokens])
    feats = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    tokens = nn.utils.rnn.pad_sequence(tokens, batch_first=True, padding_value=0)
    return feats, feat_lens, tokens, tok_lens, list(texts)


class DurationBucketSampler(Sampler):
    """Groups utterances of similar length, capped by total seconds per batch."""

    def __init__(self, durations, max_duration, rank, world_size, num_buckets=30, seed=0):
        self.durations = durations
        self.max_duration = max_duration
        self.rank = rank
        self.world_size = world_size
        self.num_buckets = num_buckets
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _make_batches(self):
        g = random.Random(self.seed + self.epoch)
        order = sorted(range(len(self.durations)), key=lambda i: self.durations[i])
        my_indices = order[self.rank::self.world_size]
        per_bucket = math.ceil(len(my_indices) / self.num_buckets)
        batches = []
        for b in range(self.num_buckets):
            bucket = my_indices[b * per_bucket:(b + 1) * per_bucket]
            g.shuffle(bucket)
            cur, cur_dur = [], 0.0
            for i in bucket:
                d = self.durations[i]
                if cur and cur_dur + d > self.max_duration:
                    batches.append(cur)
                    cur, cur_dur = [], 0.0
                cur.append(i)
                cur_dur += d
            if cur:
                batches.append(cur)
        g.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._make_batches())

    def __len__(self):
        return len(self._make_batches())


class ConformerCTC(nn.Module):
    def __init__(self, vocab_size, d_model=256, num_layers=12, num_heads=4, ffn_dim=1024):
        super().__init__()
        self.subsample = nn.Sequential(
            nn.Conv2d(1, d_model, 3, 2), nn.ReLU(),
            nn.Conv2d(d_model, d_model, 3, 2), nn.ReLU(),
        )
        self.proj = nn.Linear(d_model * 19, d_model)
        self.encoder = torchaudio.models.Conformer(
            input_dim=d_model, num_heads=num_heads, ffn_dim=ffn_dim,
            num_layers=num_layers, depthwise_conv_kernel_size=31, dropout=0.1,
        )
        self.ctc_out = nn.Linear(d_model, vocab_size)
        self.specaug = nn.Sequential(
            torchaudio.transforms.FrequencyMasking(27),
            torchaudio.transforms.FrequencyMasking(27),
            torchaudio.transforms.TimeMasking(40, p=0.05),
        )

    def forward(self, x, lens):
        if self.training:
            x = self.specaug(x.transpose(1, 2)).transpose(1, 2)
        x = self.subsample(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        lens = lens.clamp(max=t)
        x, lens = self.encoder(x, lens)
        return self.ctc_out(x).log_softmax(-1), lens


def noam_lambda(d_model, warmup):
    def fn(step):
        step = max(step, 1)
        return (d_model ** -0.5) * min(step ** -0.5, step * warmup ** -1.5) * (warmup ** 0.5) * (d_model ** 0.5)
    return fn


def greedy_decode(log_probs, lens, sp, blank=0):
    hyps = []
    preds = log_probs.argmax(-1).cpu()
    for p, l in zip(preds, lens.cpu()):
        p = torch.unique_consecutive(p[:l])
        p = [int(t) for t in p if t != blank]
        hyps.append(sp.decode(p))
    return hyps


@torch.no_grad()
def evaluate(model, loader, sp, device):
    model.eval()
    errs = torch.zeros(2, device=device, dtype=torch.float64)
    for feats, feat_lens, _, _, texts in loader:
        feats, feat_lens = feats.to(device), feat_lens.to(device)
        log_probs, out_lens = model.module(feats, feat_lens)
        hyps = greedy_decode(log_probs, out_lens, sp)
        for ref, hyp in zip(texts, hyps):
            ref = ref.lower()
            m = jiwer.process_words(ref, hyp)
            errs[0] += m.substitutions + m.deletions + m.insertions
            errs[1] += len(ref.split())
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    torch.manual_seed(args.seed)
    os.makedirs(args.exp_dir, exist_ok=True)

    sp = spm.SentencePieceProcessor(model_file=args.bpe_model)
    vocab_size = sp.get_piece_size()  # id 0 (<unk>/<blk>) is used as CTC blank

    train_items = load_manifest(args.train_manifest)
    dev_items = load_manifest(args.dev_manifest)
    train_set = AsrDataset(train_items, sp)
    dev_set = AsrDataset(dev_items, sp)

    train_sampler = DurationBucketSampler(
        [d["duration"] for d in train_items], args.max_duration, rank, world_size, seed=args.seed
    )
    train_loader = DataLoader(train_set, batch_sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, persistent_workers=True)
    dev_idx = list(range(rank, len(dev_set), world_size))
    dev_loader = DataLoader(torch.utils.data.Subset(dev_set, dev_idx), batch_size=16,
                            collate_fn=collate, num_workers=2)

    model = ConformerCTC(vocab_size, args.d_model, args.num_layers).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda(args.d_model, args.warmup_steps))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_wer = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        best_wer = ckpt.get("best_wer", best_wer)

    for epoch in range(start_epoch, args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        tot_loss, tot_frames = 0.0, 0
        for step, (feats, feat_lens, tokens, tok_lens, _) in enumerate(train_loader):
            feats = feats.to(device, non_blocking=True)
            feat_lens = feat_lens.to(device)
            tokens, tok_lens = tokens.to(device), tok_lens.to(device)

            with torch.autocast("cuda", dtype=torch.float16):
                log_probs, out_lens = model(feats, feat_lens)
            loss = F.ctc_loss(log_probs.float().transpose(0, 1), tokens, out_lens, tok_lens,
                              blank=0, reduction="sum", zero_infinity=True)
            loss = loss / feats.size(0)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            tot_loss += loss.item()
            tot_frames += 1
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.3f lr %.2e (%.1fs)", epoch, step,
                            tot_loss / tot_frames, scheduler.get_last_lr()[0], time.time() - tic)

        wer = evaluate(model, dev_loader, sp, device)
        logger.info("epoch %d dev WER %.2f%%", epoch, wer * 100)

        if rank == 0:
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "best_wer": min(best_wer, wer),
            }
            torch.save(state, os.path.join(args.exp_dir, f"epoch-{epoch}.pt"))
            if wer < best_wer:
                torch.save(state, os.path.join(args.exp_dir, "best.pt"))
        best_wer = min(best_wer, wer)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
