#!/usr/bin/env python3
"""Open-vocabulary KWS acoustic model: small CNN-LSTM trained with phoneme CTC.

At inference time keywords are matched against the phoneme posteriorgram, so
the acoustic model is trained on LibriSpeech-style utterances with phoneme
transcripts (manifest lines: {"audio": ..., "phones": "HH AH0 L OW1 ...", "duration": 3.2}).

    torchrun --nproc_per_node=8 08_ctc_phoneme_kws.py --train manifests/train_960.jsonl \
        --dev manifests/dev_clean.jsonl --lexicon-phones conf/phones.txt --exp exp/ctc_kws
"""
import argparse
import json
import logging
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("ctc_kws")


def load_phones(path):
    with open(path) as f:
        phones = [l.split()[0] for l in f if l.strip()]
    return {p: i + 1 for i, p in enumerate(phones)}  # 0 = blank


class PhoneCTCDataset(Dataset):
    def __init__(self, manifest, phone2id, max_dur=16.0, train=False):
        with open(manifest) as f:
            rows = [json.loads(l) for l in f]
        self.rows = [r for r in rows if r["duration"] <= max_dur]
        self.phone2id = phone2id
        self.train = train
        self.fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)
        self.specaug = nn.Sequential(torchaudio.transforms.FrequencyMasking(15),
                                     torchaudio.transforms.FrequencyMasking(15),
                                     torchaudio.transforms.TimeMasking(40, p=0.2),
                                     torchaudio.transforms.TimeMasking(40, p=0.2))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = torchaudio.load(r["audio"])
        if self.train:
            factor = random.choice([0.9, 1.0, 1.1])
            if factor != 1.0:
                wav = torchaudio.functional.resample(wav, int(sr * factor), sr)
        feats = (self.fbank(wav[0]) + 1e-6).log()
        feats = (feats - feats.mean(1, keepdim=True)) / (feats.std(1, keepdim=True) + 1e-5)
        if self.train:
            feats = self.specaug(feats)
        target = torch.tensor([self.phone2id[p.rstrip("012")] for p in r["phones"].split()], dtype=torch.long)
        return feats.t(), target


def collate(batch):
    feats, targets = zip(*batch)
    flen = torch.tensor([f.size(0) for f in feats])
    tlen = torch.tensor([t.numel() for t in targets])
    return pad_sequence(feats, batch_first=True), flen, torch.cat(targets), tlen


class CnnLstmCTC(nn.Module):
    def __init__(self, n_mels, n_tokens, hidden=256, layers=3):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv2d(1, 32, 3, stride=2), nn.ReLU(),
                                 nn.Conv2d(32, 32, 3, stride=2), nn.ReLU())
        sub_dim = 32 * (((n_mels - 1) // 2 - 1) // 2)
        self.proj = nn.Linear(sub_dim, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True, dropout=0.1)
        self.out = nn.Linear(hidden, n_tokens)

    def forward(self, x, lens):
        x = self.sub(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        packed = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        x, _ = self.lstm(packed)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True)
        return self.out(x).log_softmax(-1), lens


def greedy_per(log_probs, lens, targets, tlens):
    import editdistance
    errs, total, off = 0, 0, 0
    for lp, n, tl in zip(log_probs, lens, tlens):
        hyp = torch.unique_consecutive(lp[:n].argmax(-1))
        hyp = hyp[hyp != 0].tolist()
        ref = targets[off:off + tl].tolist()
        off += tl
        errs += editdistance.eval(hyp, ref)
        total += len(ref)
    return errs, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--lexicon-phones", required=True)
    ap.add_argument("--exp", default="exp/ctc_kws")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=5000)
    ap.add_argument("--grad-clip", type=float, default=5.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")
    if rank != 0:
        log.setLevel(logging.WARNING)

    phone2id = load_phones(args.lexicon_phones)
    train_ds = PhoneCTCDataset(args.train, phone2id, train=True)
    dev_ds = PhoneCTCDataset(args.dev, phone2id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    dev_dl = DataLoader(dev_ds, 32, sampler=DistributedSampler(dev_ds, shuffle=False), collate_fn=collate,
                        num_workers=4)

    model = DDP(CnnLstmCTC(80, len(phone2id) + 1).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup_steps, math.sqrt(args.warmup_steps / (s + 1))))
    ctc = nn.CTCLoss(blank=0, reduction="mean")

    os.makedirs(args.exp, exist_ok=True)
    step, best_per = 0, float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for feats, flen, targets, tlen in train_dl:
            feats, targets = feats.to(dev, non_blocking=True), targets.to(dev, non_blocking=True)
            log_probs, olen = model(feats, flen.to(dev))
            loss = ctc(log_probs.transpose(0, 1), targets, olen, tlen.to(dev))
            if not torch.isfinite(loss):
                log.warning("non-finite CTC loss at step %d, skipping batch", step)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                log.info("ep %d step %d loss %.3f gnorm %.2f lr %.2e", epoch, step, loss.item(), gnorm,
                         sched.get_last_lr()[0])

        model.eval()
        counts = torch.zeros(2, device=dev)
        with torch.no_grad():
            for feats, flen, targets, tlen in dev_dl:
                log_probs, olen = model(feats.to(dev), flen.to(dev))
                e, n = greedy_per(log_probs.cpu(), olen.cpu(), targets, tlen)
                counts += torch.tensor([e, n], device=dev, dtype=torch.float)
        dist.all_reduce(counts)
        per = (counts[0] / counts[1]).item()
        log.info("epoch %d dev PER %.2f%%", epoch, 100 * per)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "phones": phone2id, "epoch": epoch, "step": step},
                       os.path.join(args.exp, f"epoch{epoch}.pt"))
            if per < best_per:
                best_per = per
                torch.save({"model": model.module.state_dict(), "phones": phone2id},
                           os.path.join(args.exp, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
