"""Transformer-CTC on GigaSpeech-M with on-GPU log-mel extraction and speed perturbation.

torchrun --nproc_per_node=8 17_gpu_fbank_transformer_ctc.py --train data/gigaspeech_m.tsv \
    --valid data/gigaspeech_dev.tsv --spm data/spm_bpe2000.model --out exp/tfm_ctc_m
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SAMPLE_RATE = 16000


class GpuFbank(nn.Module):
    def __init__(self, n_mels=80):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=512, win_length=400,
                                                        hop_length=160, n_mels=n_mels)

    @torch.no_grad()
    def forward(self, wav):
        return torch.log(self.mel(wav) + 1e-6).transpose(-1, -2)


class TsvSpeechDataset(Dataset):
    """tsv: path \t num_samples \t transcript. Features are computed on the rank's GPU."""

    def __init__(self, tsv, sp, device, speed_perturb=False, max_samples=20 * SAMPLE_RATE):
        self.rows = []
        with open(tsv) as f:
            for line in f:
                path, n, text = line.rstrip("\n").split("\t")
                if int(n) <= max_samples:
                    self.rows.append((path, text))
        self.sp = sp
        self.device = device
        self.speed_perturb = speed_perturb
        self.fbank = GpuFbank().to(device)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        wav, sr = torchaudio.load(path)
        wav = wav.to(self.device)
        if self.speed_perturb:
            factor = random.choice([0.9, 1.0, 1.1])
            if factor != 1.0:
                wav = torchaudio.functional.resample(wav, int(sr * factor), sr)
        feats = self.fbank(wav[0])
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        tokens = torch.tensor(self.sp.encode(text.lower()), dtype=torch.long)
        return feats.cpu(), tokens


def collate(batch):
    feats, tokens = zip(*batch)
    return (nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor([f.size(0) for f in feats]),
            nn.utils.rnn.pad_sequence(tokens, batch_first=True), torch.tensor([t.size(0) for t in tokens]))


class TransformerCTC(nn.Module):
    def __init__(self, vocab, d=512, layers=12, heads=8, ff=2048, dropout=0.1):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.GELU(), nn.Conv2d(d, d, 3, 2), nn.GELU())
        self.proj = nn.Linear(d * 19, d)
        self.pos = nn.Parameter(torch.zeros(1, 3000, d))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x, lens):
        x = self.subsample(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, t, c * f)) + self.pos[:, :t]
        lens = ((lens - 1) // 2 - 1) // 2
        mask = torch.arange(t, device=x.device)[None] >= lens[:, None]
        x = self.encoder(x, src_key_padding_mask=mask)
        return self.head(x).log_softmax(-1), lens


def lr_at(step, peak, warmup, total):
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--spm", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--peak-lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    blank = sp.piece_to_id("<blank>") if sp.piece_to_id("<blank>") != sp.unk_id() else 0

    train_set = TsvSpeechDataset(args.train, sp, device, speed_perturb=True)
    valid_set = TsvSpeechDataset(args.valid, sp, device)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.workers, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=args.batch_size, sampler=valid_sampler, collate_fn=collate,
                              num_workers=args.workers)

    model = TransformerCTC(sp.get_piece_size()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=0.01)
    scaler = torch.cuda.amp.GradScaler()
    total_steps = args.epochs * len(train_loader)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, xl, y, yl in train_loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.peak_lr, args.warmup, total_steps)
            x, xl, y, yl = x.to(device, non_blocking=True), xl.to(device), y.to(device), yl.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                lp, ol = model(x, xl)
            loss = F.ctc_loss(lp.float().transpose(0, 1), y, ol, yl, blank=blank, zero_infinity=True)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                      f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, xl, y, yl in valid_loader:
                x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
                lp, ol = model.module(x, xl)
                acc[0] += F.ctc_loss(lp.transpose(0, 1), y, ol, yl, blank=blank, reduction="sum",
                                     zero_infinity=True)
                acc[1] += yl.sum()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} valid ctc/token {(acc[0] / acc[1]).item():.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                        "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(args.out, f"ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
