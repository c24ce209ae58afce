#!/usr/bin/env python
"""Audio-visual speech recognition on LRS3 with modality dropout.

Hybrid CTC/attention model: ResNet-18 visual frontend on 88x88 mouth crops,
strided 1D conv audio frontend on the raw 16 kHz waveform, concatenation
fusion, transformer encoder and a transformer decoder over sentencepiece units.

    torchrun --nproc_per_node=8 01_avsr_modality_dropout.py \
        --data-root /data/lrs3 --sp-model spm/unigram1000.model
"""
import argparse
import logging
import math
import os
import random

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("avsr")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--sp-model", required=True)
    p.add_argument("--out-dir", default="exp/avsr_mdrop")
    p.add_argument("--epochs", type=int, default=75)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=5000)
    p.add_argument("--ctc-weight", type=float, default=0.1)
    p.add_argument("--p-drop-video", type=float, default=0.25)
    p.add_argument("--p-drop-audio", type=float, default=0.25)
    p.add_argument("--max-frames", type=int, default=450)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class LRS3AV(Dataset):
    """Rows of <split>.tsv: uid, mouth-crop .npy, wav, n_frames, transcript."""

    def __init__(self, root, split, sp, max_frames):
        self.root = root
        self.sp = sp
        self.items = []
        with open(os.path.join(root, f"{split}.tsv")) as f:
            for line in f:
                uid, vpath, apath, n, text = line.rstrip("\n").split("\t")
                if int(n) <= max_frames:
                    self.items.append((vpath, apath, text))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vpath, apath, text = self.items[i]
        video = torch.from_numpy(np.load(os.path.join(self.root, vpath))).float() / 255.0
        video = (video - 0.421) / 0.165
        wav, _ = torchaudio.load(os.path.join(self.root, apath))
        wav = wav[0]
        n_samples = video.size(0) * 640  # 25 fps video, 16 kHz audio
        wav = wav[:n_samples]
        if wav.numel() < n_samples:
            wav = F.pad(wav, (0, n_samples - wav.numel()))
        wav = (wav - wav.mean()) / (wav.std() + 1e-5)
        tokens = torch.tensor([t + 1 for t in self.sp.encode(text.lower())], dtype=torch.long)
        return video, wav, tokens


def collate(batch):
    videos, wavs, toks = zip(*batch)
    v_lens = torch.tensor([v.size(0) for v in videos])
    t_lens = torch.tensor([t.size(0) for t in toks])
    return (pad_sequence(videos, batch_first=True), pad_sequence(wavs, batch_first=True),
            v_lens, pad_sequence(toks, batch_first=True, padding_value=-1), t_lens)


class VisualFrontend(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
            nn.BatchNorm3d(64), nn.ReLU(inplace=True),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        r = torchvision.models.resnet18()
        self.trunk = nn.Sequential(r.layer1, r.layer2, r.layer3, r.layer4, nn.AdaptiveAvgPool2d(1))
        self.proj = nn.Linear(512, d_model)

    def forward(self, x):  # B, T, H, W
        b, t = x.shape[:2]
        x = self.stem(x.unsqueeze(1)).transpose(1, 2)
        x = x.reshape(b * t, *x.shape[2:])
        x = self.trunk(x).flatten(1)
        return self.proj(x).view(b, t, -1)


class AudioFrontend(nn.Module):
    """Raw waveform -> 25 Hz frames (total stride 640)."""

    def __init__(self, d_model):
        super().__init__()
        layers, c_in = [], 1
        for c_out, k, s in [(64, 10, 5), (128, 8, 4), (256, 8, 4), (256, 4, 2), (512, 4, 2), (512, 4, 2)]:
            layers += [nn.Conv1d(c_in, c_out, k, s, padding=(k - s) // 2), nn.GroupNorm(1, c_out), nn.GELU()]
            c_in = c_out
        self.conv = nn.Sequential(*layers)
        self.proj = nn.Linear(512, d_model)

    def forward(self, wav, n_frames):
        x = self.conv(wav.unsqueeze(1)).transpose(1, 2)
        x = x[:, :n_frames]
        if x.size(1) < n_frames:
            x = F.pad(x, (0, 0, 0, n_frames - x.size(1)))
        return self.proj(x)


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=2000):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)]


class AVSR(nn.Module):
    def __init__(self, vocab, d_model=512, n_enc=12, n_dec=6):
        super().__init__()
        self.vocab = vocab
        self.video = VisualFrontend(d_model)
        self.audio = AudioFrontend(d_model)
        self.fuse = nn.Sequential(nn.Linear(2 * d_model, d_model), nn.LayerNorm(d_model))
        self.pos = PositionalEncoding(d_model)
        enc = nn.TransformerEncoderLayer(d_model, 8, 2048, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, n_enc)
        dec = nn.TransformerDecoderLayer(d_model, 8, 2048, 0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(dec, n_dec)
        self.embed = nn.Embedding(vocab, d_model)
        self.ctc_head = nn.Linear(d_model, vocab)
        self.att_head = nn.Linear(d_model, vocab)

    def encode(self, video, wav, v_lens, drop_video=False, drop_audio=False):
        t = video.size(1)
        if drop_video:
            v = video.new_zeros(video.size(0), t, self.fuse[0].in_features // 2)
        else:
            v = self.video(video)
        if drop_audio:
            a = torch.zeros_like(v)
        else:
            a = self.audio(wav, t)
        pad_mask = torch.arange(t, device=video.device)[None] >= v_lens[:, None]
        x = self.pos(self.fuse(torch.cat([v, a], dim=-1)))
        return self.encoder(x, src_key_padding_mask=pad_mask), pad_mask

    def forward(self, video, wav, v_lens, dec_in, drop_video=False, drop_audio=False):
        mem, pad_mask = self.encode(video, wav, v_lens, drop_video, drop_audio)
        ctc_logp = self.ctc_head(mem).log_softmax(-1)
        causal = nn.Transformer.generate_square_subsequent_mask(dec_in.size(1), device=dec_in.device)
        y = self.pos(self.embed(dec_in))
        y = self.decoder(y, mem, tgt_mask=causal, tgt_is_causal=True,
                         tgt_key_padding_mask=dec_in.eq(0), memory_key_padding_mask=pad_mask)
        return ctc_logp, self.att_head(y)


def make_dec_io(toks, t_lens, sos_eos):
    b = toks.size(0)
    dec_in = torch.zeros(b, toks.size(1) + 1, dtype=torch.long, device=toks.device)
    dec_out = torch.full_like(dec_in, -1)
    dec_in[:, 0] = sos_eos
    for i in range(b):
        n = t_lens[i]
        dec_in[i, 1:n + 1] = toks[i, :n]
        dec_out[i, :n] = toks[i, :n]
        dec_out[i, n] = sos_eos
    return dec_in, dec_out


def compute_loss(ctc_logp, att_logits, toks, t_lens, v_lens, dec_out, ctc_weight):
    flat = torch.cat([toks[i, :t_lens[i]] for i in range(toks.size(0))])
    ctc = F.ctc_loss(ctc_logp.transpose(0, 1).float(), flat, v_lens, t_lens,
                     blank=0, reduction="mean", zero_infinity=True)
    att = F.cross_entropy(att_logits.flatten(0, 1).float(), dec_out.flatten(),
                          ignore_index=-1, label_smoothing=0.1)
    return ctc_weight * ctc + (1 - ctc_weight) * att


@torch.no_grad()
def evaluate(model, loader, device, sp):
    model.eval()
    errs, words = 0, 0
    for video, wav, v_lens, toks, t_lens in loader:
        video, wav, v_lens = video.to(device), wav.to(device), v_lens.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mem, _ = model.encode(video, wav, v_lens)
            pred = model.ctc_head(mem).argmax(-1).cpu()
        for i in range(pred.size(0)):
            seq = torch.unique_consecutive(pred[i, :v_lens[i]]).tolist()
            hyp = sp.decode([s - 1 for s in seq if 0 < s < model.vocab - 1]).split()
            ref = sp.decode([t - 1 for t in toks[i, :t_lens[i]].tolist()]).split()
            errs += editdistance.eval(hyp, ref)
            words += len(ref)
    model.train()
    return errs / max(words, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    sp = spm.SentencePieceProcessor(model_file=args.sp_model)
    vocab = sp.get_piece_size() + 2  # blank=0, pieces shifted by one, sos/eos last
    sos_eos = vocab - 1

    train_set = LRS3AV(args.data_root, "train", sp, args.max_frames)
    val_set = LRS3AV(args.data_root, "val", sp, 10_000)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=8, shuffle=False, num_workers=4, collate_fn=collate)

    model = AVSR(vocab, args.d_model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.03)
    total_steps = args.epochs * len(train_loader)

    def lr_lambda(step):
        if step < args.warmup_steps:
            return step / args.warmup_steps
        prog = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * prog))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    start_epoch, best_wer = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_wer = ckpt["epoch"] + 1, ckpt["best_wer"]

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for video, wav, v_lens, toks, t_lens in train_loader:
            video = video.to(device, non_blocking=True)
            wav = wav.to(device, non_blocking=True)
            v_lens, toks, t_lens = v_lens.to(device), toks.to(device), t_lens.to(device)
            dec_in, dec_out = make_dec_io(toks, t_lens, sos_eos)

            # drop at most one modality per batch
            r = random.random()
            drop_video = r < args.p_drop_video
            drop_audio = (not drop_video) and r < args.p_drop_video + args.p_drop_audio

            with torch.autocast("cuda", dtype=torch.bfloat16):
                ctc_logp, att_logits = model(video, wav, v_lens, dec_in, drop_video, drop_audio)
            loss = compute_loss(ctc_logp, att_logits, toks, t_lens, v_lens, dec_out, args.ctc_weight)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(),
                            scheduler.get_last_lr()[0])

        if rank == 0:
            wer = evaluate(model.module, val_loader, device, sp)
            logger.info("epoch %d val WER %.2f%%", epoch, 100 * wer)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch,
                     "best_wer": min(best_wer, wer)}
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
