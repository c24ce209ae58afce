#!/usr/bin/env python
# AV-ASR training on LRS3 pretrain+trainval straight from the raw .mp4 files.
# Mouth ROIs are cropped from the released 68-point landmarks the first time a clip
# is seen and cached as uint8 .npy next to a 16 kHz wav, so later epochs/jobs skip decoding.
import argparse
import json
import math
import os
import pickle
import time

import cv2
import jiwer
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import Conformer

ROI = 96


def read_list(path):
    items = []
    with open(path) as f:
        for line in f:
            rel, text = line.strip().split(" ", 1)
            items.append({"id": rel, "text": text})
    return items


def crop_mouth(frames, landmarks):
    """frames: list of HxWx3 BGR, landmarks: [T, 68, 2]. Returns uint8 [T, ROI, ROI]."""
    out = []
    # smooth the mouth centre over a 12-frame window to avoid jitter
    centres = landmarks[:, 48:68].mean(axis=1)
    kernel = np.ones(12) / 12.0
    smoothed = np.stack([np.convolve(np.pad(centres[:, k], 6, mode="edge"), kernel, "same")[6:-6]
                         for k in range(2)], axis=1)
    for img, (cx, cy) in zip(frames, smoothed):
        gray = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
        x0 = int(round(cx)) - ROI // 2
        y0 = int(round(cy)) - ROI // 2
        gray = cv2.copyMakeBorder(gray, ROI, ROI, ROI, ROI, cv2.BORDER_REPLICATE)
        out.append(gray[y0 + ROI:y0 + 2 * ROI, x0 + ROI:x0 + 2 * ROI])
    return np.stack(out).astype(np.uint8)


def prepare_cache(items, raw_root, lmk_root, cache_root, log_every=2000):
    """Decode video, crop the mouth and extract 16 kHz audio for every clip that is not cached yet."""
    t0 = time.time()
    for n, it in enumerate(items):
        v_out = os.path.join(cache_root, it["id"] + ".npy")
        a_out = os.path.join(cache_root, it["id"] + ".wav")
        if os.path.exists(v_out) and os.path.exists(a_out):
            continue
        os.makedirs(os.path.dirname(v_out), exist_ok=True)
        mp4 = os.path.join(raw_root, it["id"] + ".mp4")
        cap = cv2.VideoCapture(mp4)
        frames = []
        ok, img = cap.read()
        while ok:
            frames.append(img)
            ok, img = cap.read()
        cap.release()
        with open(os.path.join(lmk_root, it["id"] + ".pkl"), "rb") as f:
            lmk = np.asarray(pickle.load(f), dtype=np.float32)
        np.save(v_out, crop_mouth(frames, lmk[: len(frames)]))
        wav, sr = torchaudio.load(mp4)
        wav = torchaudio.functional.resample(wav.mean(0, keepdim=True), sr, 16000)
        torchaudio.save(a_out, wav, 16000)
        if n % log_every == 0:
            print(f"  cached {n}/{len(items)} ({time.time() - t0:.0f}s)", flush=True)


class CachedAV(Dataset):
    def __init__(self, items, cache_root, sp, train):
        self.items, self.cache_root, self.sp, self.train = items, cache_root, sp, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        video = torch.from_numpy(np.load(os.path.join(self.cache_root, it["id"] + ".npy"))).float() / 255.0
        if self.train:
            y, x = torch.randint(0, 9, (2,)).tolist()
            video = video[:, y:y + 88, x:x + 88]
        else:
            video = video[:, 4:92, 4:92]
        video = (video - 0.421) / 0.165
        wav, _ = torchaudio.load(os.path.join(self.cache_root, it["id"] + ".wav"))
        fbank = torchaudio.compliance.kaldi.fbank(wav * 32768, num_mel_bins=80, frame_shift=10, frame_length=25)
        need = video.size(0) * 4
        fbank = fbank[:need] if fbank.size(0) >= need else F.pad(fbank, (0, 0, 0, need - fbank.size(0)))
        fbank = (fbank - fbank.mean(0)) / (fbank.std(0) + 1e-5)
        ids = torch.tensor(self.sp.encode(it["text"].lower()), dtype=torch.long) + 1
        return video, fbank, ids, it["text"]


def collate(batch):
    videos, fbanks, ids, texts = zip(*batch)
    lens = torch.tensor([v.shape[0] for v in videos])
    return (nn.utils.rnn.pad_sequence(videos, batch_first=True), nn.utils.rnn.pad_sequence(fbanks, batch_first=True),
            lens, nn.utils.rnn.pad_sequence(ids, batch_first=True), torch.tensor([len(x) for x in ids]), list(texts))


class Frontend(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.v = nn.Sequential(
            nn.Conv3d(1, 32, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(32), nn.SiLU(),
            nn.Conv3d(32, 64, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(64), nn.SiLU(),
            nn.Conv3d(64, 128, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(128), nn.SiLU(),
            nn.Conv3d(128, 256, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(256), nn.SiLU(),
        )
        self.v_proj = nn.Linear(256, d)
        self.a = nn.Sequential(nn.Conv1d(80, d, 5, 2, 2), nn.SiLU(), nn.Conv1d(d, d, 5, 2, 2), nn.SiLU())
        self.fuse = nn.Linear(2 * d, d)

    def forward(self, video, fbank):
        t = video.size(1)
        v = self.v(video.unsqueeze(1)).mean((3, 4)).transpose(1, 2)
        a = self.a(fbank.transpose(1, 2)).transpose(1, 2)[:, :t]
        return self.fuse(torch.cat([self.v_proj(v), a], -1))


class AVConformer(nn.Module):
    def __init__(self, vocab, d=256, layers=12):
        super().__init__()
        self.frontend = Frontend(d)
        self.encoder = Conformer(input_dim=d, num_heads=4, ffn_dim=4 * d, num_layers=layers,
                                 depthwise_conv_kernel_size=31, dropout=0.1)
        self.ctc = nn.Linear(d, vocab)
        self.emb = nn.Embedding(vocab, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 4, 4 * d, 0.1, batch_first=True), 6)
        self.out = nn.Linear(d, vocab)
        self.sos = vocab - 1

    def encode(self, video, fbank, lens):
        x, lens = self.encoder(self.frontend(video, fbank), lens)
        return x, lens

    def forward(self, video, fbank, lens, ys, ys_lens, ctc_weight=0.1):
        enc, lens = self.encode(video, fbank, lens)
        lp = self.ctc(enc).log_softmax(-1).float()
        l_ctc = F.ctc_loss(lp.transpose(0, 1), ys, lens, ys_lens, zero_infinity=True)
        pad = torch.arange(ys.size(1) + 1, device=ys.device)[None] > ys_lens[:, None]
        ys_in = F.pad(ys, (1, 0), value=self.sos)
        ys_out = F.pad(ys, (0, 1), value=0).scatter(1, ys_lens[:, None], self.sos).masked_fill(pad, -100)
        L = ys_in.size(1)
        causal = torch.triu(torch.full((L, L), float("-inf"), device=ys.device), 1)
        mem_pad = torch.arange(enc.size(1), device=ys.device)[None] >= lens[:, None]
        h = self.decoder(self.emb(ys_in), enc, tgt_mask=causal, memory_key_padding_mask=mem_pad)
        l_att = F.cross_entropy(self.out(h).flatten(0, 1).float(), ys_out.flatten(), ignore_index=-100,
                                label_smoothing=0.1)
        return ctc_weight * l_ctc + (1 - ctc_weight) * l_att, l_ctc, l_att


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw-root", default="/data/lrs3/raw")
    ap.add_argument("--landmark-root", default="/data/lrs3/landmarks")
    ap.add_argument("--cache-root", default="/data/lrs3/roi_cache")
    ap.add_argument("--train-list", default="lists/lrs3_train.txt")
    ap.add_argument("--valid-list", default="lists/lrs3_valid.txt")
    ap.add_argument("--spm", default="spm/unigram1000.model")
    ap.add_argument("--exp", default="exp/avconformer")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bsz", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=15000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train_items, valid_items = read_list(args.train_list), read_list(args.valid_list)
    prepare_cache(train_items + valid_items, args.raw_root, args.landmark_root, args.cache_root)
    dist.barrier()

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    vocab = sp.get_piece_size() + 2
    train_ds = CachedAV(train_items, args.cache_root, sp, train=True)
    valid_ds = CachedAV(valid_items, args.cache_root, sp, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bsz, sampler=sampler, num_workers=8, collate_fn=collate,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), args.bsz, num_workers=4,
                          collate_fn=collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AVConformer(vocab)).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    d_model = 256
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) ** -0.5, (s + 1) * args.warmup ** -1.5) * args.warmup ** 0.5)

    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        with open(os.path.join(args.exp, "args.json"), "w") as f:
            json.dump(vars(args) | {"d_model": d_model, "world": world}, f, indent=2)

    best = math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (video, fbank, lens, ys, ys_lens, _) in enumerate(train_dl):
            video, fbank, lens = video.to(dev, non_blocking=True), fbank.to(dev, non_blocking=True), lens.to(dev)
            ys, ys_lens = ys.to(dev), ys_lens.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, l_ctc, l_att = model(video, fbank, lens, ys, ys_lens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.3f} ctc {l_ctc.item():.3f} "
                      f"att {l_att.item():.3f} gn {gn:.2f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        # validation: greedy CTC, WER pooled over ranks
        model.eval()
        hyps, refs = [], []
        with torch.no_grad():
            for video, fbank, lens, _, _, texts in valid_dl:
                enc, elens = model.module.encode(video.to(dev), fbank.to(dev), lens.to(dev))
                best_path = model.module.ctc(enc).argmax(-1)
                for p, n in zip(best_path, elens.tolist()):
                    p = torch.unique_consecutive(p[:n]).tolist()
                    hyps.append(sp.decode([t - 1 for t in p if 0 < t < vocab - 1]))
                refs.extend(t.lower() for t in texts)
        gathered = [None] * world
        dist.all_gather_object(gathered, (hyps, refs))
        if rank == 0:
            all_h = [h for g in gathered for h in g[0]]
            all_r = [r for g in gathered for r in g[1]]
            wer = jiwer.wer(all_r, all_h)
            print(f"epoch {epoch} valid WER {wer * 100:.2f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.exp, "last.pt"))
            if wer < best:
                best = wer
                torch.save(state, os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
