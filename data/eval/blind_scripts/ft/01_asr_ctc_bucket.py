#!/usr/bin/env python
"""CTC acoustic model on log-mel features with duration-bucketed dynamic batches.

    torchrun --nproc_per_node=8 01_asr_ctc_bucket.py \
        --train-manifest data/train.jsonl --valid-manifest data/dev.jsonl \
        --vocab data/chars.txt --out exp/ctc_base
"""
import argparse
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("ctc")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--valid-manifest", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-frames", type=int, default=40000, help="padded frames per GPU batch")
    p.add_argument("--max-duration", type=float, default=20.0)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10000)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class ManifestDataset(Dataset):
    def __init__(self, manifest, char2id, max_duration):
        self.items = []
        with open(manifest) as f:
            for line in f:
                ex = json.loads(line)
                if ex["duration"] <= max_duration:
                    self.items.append(ex)
        self.char2id = char2id
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=16000, n_fft=400, hop_length=160, n_mels=80)

    def __len__(self):
        return len(self.items)

    def num_frames(self, i):
        return int(self.items[i]["duration"] * 100) + 1

    def __getitem__(self, i):
        ex = self.items[i]
        wav, sr = torchaudio.load(ex["audio"])
        if sr != 16000:
            wav = torchaudio.functional.resample(wav, sr, 16000)
        feats = (self.mel(wav[0]) + 1e-6).log().transpose(0, 1)
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        tokens = [self.char2id[c] for c in ex["text"].lower() if c in self.char2id]
        return feats, torch.tensor(tokens, dtype=torch.long)


def collate(batch):
    feats, tokens = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats])
    tok_lens = torch.tensor([t.size(0) for t in tokens])
    feats = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    tokens = nn.utils.rnn.pad_sequence(tokens, batch_first=True)
    return feats, feat_lens, tokens, tok_lens


class DistributedDurationBatchSampler(Sampler):
    """Sorts utterances by length inside large random chunks, cuts them into batches of at
    most `max_frames` padded frames and deals the batches out to the ranks."""

    def __init__(self, lengths, max_frames, num_replicas, rank, shuffle=True, seed=0,
                 chunk_size=6400, pad_to_even=True):
        self.lengths = lengths
        self.max_frames = max_frames
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.chunk_size = chunk_size
        self.pad_to_even = pad_to_even
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.shuffle:
            order = torch.randperm(len(self.lengths), generator=g).tolist()
        else:
            order = list(range(len(self.lengths)))
        batches = []
        for s in range(0, len(order), self.chunk_size):
            part = sorted(order[s:s + self.chunk_size], key=lambda i: self.lengths[i])
            cur, cur_max = [], 0
            for i in part:
                new_max = max(cur_max, self.lengths[i])
                if cur and new_max * (len(cur) + 1) > self.max_frames:
                    batches.append(cur)
                    cur, new_max = [], self.lengths[i]
                cur.append(i)
                cur_max = new_max
            if cur:
                batches.append(cur)
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[j] for j in perm]
        if self.pad_to_even:
            rem = len(batches) % self.num_replicas
            if rem:
                batches += batches[: self.num_replicas - rem]
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class ConvSubsample(nn.Module):
    def __init__(self, n_mels, d_model):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, 3, stride=2), nn.GELU(),
            nn.Conv2d(32, 32, 3, stride=2), nn.GELU())
        self.proj = nn.Linear(32 * (((n_mels - 1) // 2 - 1) // 2), d_model)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        return x, lens


class CTCModel(nn.Module):
    def __init__(self, vocab_size, d_model, layers, n_mels=80, heads=8, max_len=4096):
        super().__init__()
        self.subsample = ConvSubsample(n_mels, d_model)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, feats, feat_lens):
        x, lens = self.subsample(feats, feat_lens)
        x = x + self.pos[:, : x.size(1)]
        pad_mask = torch.arange(x.size(1), device=x.device)[None, :] >= lens[:, None]
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        return self.head(self.norm(x)), lens


def greedy_decode(logits, lens):
    hyps = []
    for row, n in zip(logits.argmax(-1).cpu(), lens.cpu()):
        ids = torch.unique_consecutive(row[:n]).tolist()
        hyps.append([i for i in ids if i != 0])
    return hyps


@torch.no_grad()
def evaluate(model, loader, ctc, device):
    model.eval()
    stats = torch.zeros(4, device=device)  # loss_sum, n_utts, char_errors, n_chars
    for feats, feat_lens, tokens, tok_lens in loader:
        feats, feat_lens = feats.to(device), feat_lens.to(device)
        tokens, tok_lens = tokens.to(device), tok_lens.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, out_lens = model(feats, feat_lens)
        log_probs = logits.float().log_softmax(-1)
        loss = ctc(log_probs.transpose(0, 1), tokens, out_lens, tok_lens)
        stats[0] += loss.item() * feats.size(0)
        stats[1] += feats.size(0)
        for hyp, ref, n in zip(greedy_decode(log_probs, out_lens), tokens.cpu(), tok_lens.cpu()):
            stats[2] += torchaudio.functional.edit_distance(hyp, ref[:n].tolist())
            stats[3] += n.item()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [rank %(process)d] %(message)s")
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    with open(args.vocab, encoding="utf-8") as f:
        chars = [line.rstrip("\n") for line in f if line.rstrip("\n")]
    char2id = {c: i + 1 for i, c in enumerate(chars)}  # 0 is the CTC blank

    train_ds = ManifestDataset(args.train_manifest, char2id, args.max_duration)
    valid_ds = ManifestDataset(args.valid_manifest, char2id, args.max_duration)
    train_sampler = DistributedDurationBatchSampler(
        [train_ds.num_frames(i) for i in range(len(train_ds))], args.max_frames,
        world_size, rank, shuffle=True, seed=args.seed)
    valid_sampler = DistributedDurationBatchSampler(
        [valid_ds.num_frames(i) for i in range(len(valid_ds))], args.max_frames,
        world_size, rank, shuffle=False, pad_to_even=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_sampler=valid_sampler, collate_fn=collate,
                              num_workers=2, pin_memory=True)

    model = CTCModel(len(chars) + 1, args.d_model, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-2)
    total_steps = args.epochs * len(train_sampler)

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    step, best_cer = 0, float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for feats, feat_lens, tokens, tok_lens in train_loader:
            feats = feats.to(device, non_blocking=True)
            feat_lens = feat_lens.to(device, non_blocking=True)
            tokens = tokens.to(device, non_blocking=True)
            tok_lens = tok_lens.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, out_lens = model(feats, feat_lens)
            loss = ctc(logits.float().log_softmax(-1).transpose(0, 1), tokens, out_lens, tok_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f gnorm %.2f lr %.2e", epoch, step,
                            loss.item(), gnorm.item(), scheduler.get_last_lr()[0])
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

        val_loss, val_cer = evaluate(model.module, valid_loader, ctc, device)
        if rank == 0:
            logger.info("epoch %d done in %.0fs  valid loss %.4f  CER %.2f%%", epoch,
                        time.time() - t0, val_loss, 100 * val_cer)
            writer.add_scalar("valid/loss", val_loss, step)
            writer.add_scalar("valid/cer", val_cer, step)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
                    "vocab": chars, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if val_cer < best_cer:
                best_cer = val_cer
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
