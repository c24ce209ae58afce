"""FastSpeech2 training (DDP). Features are extracted once into --feature_dir."""
import argparse
import datetime
import json
import math
import os

import librosa
import numpy as np
import pyworld as pw
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from text import text_to_sequence, symbols


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--metadata", default="data/LJSpeech/metadata.csv")
    p.add_argument("--wav_dir", default="data/LJSpeech/wavs")
    p.add_argument("--duration_dir", default="data/LJSpeech/durations")
    p.add_argument("--feature_dir", default="data/LJSpeech/features")
    p.add_argument("--out_dir", default="runs/fs2")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max_steps", type=int, default=200000)
    p.add_argument("--save_every", type=int, default=10000)
    p.add_argument("--val_every", type=int, default=2000)
    p.add_argument("--sr", type=int, default=22050)
    p.add_argument("--hop", type=int, default=256)
    p.add_argument("--n_mels", type=int, default=80)
    p.add_argument("--n_bins", type=int, default=256)
    p.add_argument("--resume", default="")
    return p.parse_args()


def extract_features(args, items):
    os.makedirs(args.feature_dir, exist_ok=True)
    pitch_all, energy_all = [], []
    for utt, _ in tqdm(items, desc="features"):
        wav, _ = librosa.load(os.path.join(args.wav_dir, utt + ".wav"), sr=args.sr)
        dur = np.load(os.path.join(args.duration_dir, utt + ".npy"))
        stft = librosa.stft(wav, n_fft=1024, hop_length=args.hop, win_length=1024)
        mag = np.abs(stft)
        mel = np.log(np.clip(librosa.feature.melspectrogram(S=mag, sr=args.sr, n_mels=args.n_mels,
                                                            fmin=0, fmax=8000), 1e-5, None))
        f0, t = pw.dio(wav.astype(np.float64), args.sr, frame_period=args.hop / args.sr * 1000)
        f0 = pw.stonemask(wav.astype(np.float64), f0, t, args.sr)
        energy = np.linalg.norm(mag, axis=0)
        n = int(dur.sum())
        mel, f0, energy = mel[:, :n], f0[:n], energy[:n]
        # phoneme-level averages
        pos, p_avg, e_avg = 0, [], []
        for d in dur:
            seg = f0[pos:pos + d]
            voiced = seg[seg > 0]
            p_avg.append(voiced.mean() if len(voiced) else 0.0)
            e_avg.append(energy[pos:pos + d].mean() if d > 0 else 0.0)
            pos += d
        p_avg, e_avg = np.array(p_avg, dtype=np.float32), np.array(e_avg, dtype=np.float32)
        np.save(os.path.join(args.feature_dir, f"{utt}-mel.npy"), mel.T.astype(np.float32))
        np.save(os.path.join(args.feature_dir, f"{utt}-pitch.npy"), p_avg)
        np.save(os.path.join(args.feature_dir, f"{utt}-energy.npy"), e_avg)
        pitch_all.append(p_avg[p_avg > 0]); energy_all.append(e_avg)
    pitch_all, energy_all = np.concatenate(pitch_all), np.concatenate(energy_all)
    stats = {"pitch": [float(pitch_all.min()), float(pitch_all.max()), float(pitch_all.mean()), float(pitch_all.std())],
             "energy": [float(energy_all.min()), float(energy_all.max()), float(energy_all.mean()), float(energy_all.std())]}
    tmp = os.path.join(args.feature_dir, "stats.json.tmp")
    with open(tmp, "w") as f:
        json.dump(stats, f)
    os.replace(tmp, os.path.join(args.feature_dir, "stats.json"))


class FS2Dataset(Dataset):
    def __init__(self, items, args, stats):
        self.items, self.args = items, args
        self.p_mean, self.p_std = stats["pitch"][2], stats["pitch"][3]
        self.e_mean, self.e_std = stats["energy"][2], stats["energy"][3]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        utt, text = self.items[i]
        d = self.args.feature_dir
        phones = torch.LongTensor(text_to_sequence(text, ["english_cleaners"]))
        mel = torch.from_numpy(np.load(os.path.join(d, f"{utt}-mel.npy")))
        pitch = np.load(os.path.join(d, f"{utt}-pitch.npy"))
        pitch = np.where(pitch > 0, (pitch - self.p_mean) / self.p_std, 0.0)
        energy = (np.load(os.path.join(d, f"{utt}-energy.npy")) - self.e_mean) / self.e_std
        dur = torch.from_numpy(np.load(os.path.join(self.args.duration_dir, utt + ".npy"))).long()
        return phones, mel, torch.FloatTensor(pitch), torch.FloatTensor(energy), dur


def collate(batch):
    def pad(seqs, value=0):
        return nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)
    phones, mels, pitch, energy, dur = zip(*batch)
    src_lens = torch.LongTensor([len(p) for p in phones])
    mel_lens = torch.LongTensor([len(m) for m in mels])
    return pad(phones), src_lens, pad(mels), mel_lens, pad(pitch), pad(energy), pad(dur)


def mask_from_lens(lens, max_len=None):
    max_len = max_len or int(lens.max())
    return torch.arange(max_len, device=lens.device)[None, :] >= lens[:, None]


class FFTBlock(nn.Module):
    def __init__(self, d, heads=2, k=9, dropout=0.1):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.conv = nn.Sequential(nn.Conv1d(d, 1024, k, padding=k // 2), nn.ReLU(), nn.Conv1d(1024, d, 1))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        a, _ = self.attn(x, x, x, key_padding_mask=mask)
        x = self.norm1(x + self.drop(a)).masked_fill(mask.unsqueeze(-1), 0)
        c = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.norm2(x + self.drop(c)).masked_fill(mask.unsqueeze(-1), 0)


class VariancePredictor(nn.Module):
    def __init__(self, d, k=3, dropout=0.5):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(d, 256, k, padding=1), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Conv1d(256, 256, k, padding=1), nn.ReLU(), nn.Dropout(dropout))
        self.proj = nn.Linear(256, 1)

    def forward(self, x, mask):
        y = self.net(x.transpose(1, 2)).transpose(1, 2)
        return self.proj(y).squeeze(-1).masked_fill(mask, 0.0)


class FastSpeech2(nn.Module):
    def __init__(self, n_symbols, n_mels, n_bins, stats, d=256, layers=4):
        super().__init__()
        self.emb = nn.Embedding(n_symbols, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, 2000, d) * 0.02)
        self.encoder = nn.ModuleList([FFTBlock(d) for _ in range(layers)])
        self.decoder = nn.ModuleList([FFTBlock(d) for _ in range(layers)])
        self.duration_predictor = VariancePredictor(d)
        self.pitch_predictor = VariancePredictor(d)
        self.energy_predictor = VariancePredictor(d)
        p_lo = (stats["pitch"][0] - stats["pitch"][2]) / stats["pitch"][3]
        p_hi = (stats["pitch"][1] - stats["pitch"][2]) / stats["pitch"][3]
        self.register_buffer("pitch_bins", torch.linspace(p_lo, p_hi, n_bins - 1))
        self.register_buffer("energy_bins", torch.linspace(-3.0, 3.0, n_bins - 1))
        self.pitch_emb = nn.Embedding(n_bins, d)
        self.energy_emb = nn.Embedding(n_bins, d)
        self.mel_linear = nn.Linear(d, n_mels)

    @staticmethod
    def length_regulate(x, dur, max_len=None):
        out = [torch.repeat_interleave(xi, di, dim=0) for xi, di in zip(x, dur)]
        lens = torch.LongTensor([o.size(0) for o in out]).to(x.device)
        return nn.utils.rnn.pad_sequence(out, batch_first=True), lens

    def forward(self, phones, src_lens, dur_target=None, pitch_target=None, energy_target=None, d_control=1.0):
        src_mask = mask_from_lens(src_lens, phones.size(1))
        x = self.emb(phones) + self.pos[:, :phones.size(1)]
        for blk in self.encoder:
            x = blk(x, src_mask)
        log_d_pred = self.duration_predictor(x, src_mask)
        p_pred = self.pitch_predictor(x, src_mask)
        e_pred = self.energy_predictor(x, src_mask)
        p = pitch_target if pitch_target is not None else p_pred
        e = energy_target if energy_target is not None else e_pred
        x = x + self.pitch_emb(torch.bucketize(p, self.pitch_bins)) + self.energy_emb(torch.bucketize(e, self.energy_bins))
        if dur_target is not None:
            dur = dur_target
        else:
            dur = torch.clamp(torch.round((torch.exp(log_d_pred) - 1) * d_control), min=0).long()
        x, mel_lens = self.length_regulate(x, dur)
        mel_mask = mask_from_lens(mel_lens, x.size(1))
        x = x + self.pos[:, :x.size(1)]
        for blk in self.decoder:
            x = blk(x, mel_mask)
        return self.mel_linear(x), log_d_pred, p_pred, e_pred, src_mask, mel_mask, mel_lens


def fs2_loss(out, mel_t, pitch_t, energy_t, dur_t):
    mel_pred, log_d_pred, p_pred, e_pred, src_mask, mel_mask, _ = out
    keep_src, keep_mel = ~src_mask, ~mel_mask
    mel_pred = mel_pred[:, :mel_t.size(1)]
    mel_loss = F.l1_loss(mel_pred.masked_select(keep_mel.unsqueeze(-1)), mel_t.masked_select(keep_mel.unsqueeze(-1)))
    d_loss = F.mse_loss(log_d_pred.masked_select(keep_src), torch.log(dur_t.float() + 1).masked_select(keep_src))
    p_loss = F.mse_loss(p_pred.masked_select(keep_src), pitch_t.masked_select(keep_src))
    e_loss = F.mse_loss(e_pred.masked_select(keep_src), energy_t.masked_select(keep_src))
    return mel_loss + d_loss + p_loss + e_loss, torch.stack([mel_loss, d_loss, p_loss, e_loss]).detach()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # feature extraction on rank 0 can take a while, keep the others waiting at the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=4))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.metadata, encoding="utf-8") as f:
        items = [(l.split("|")[0], l.strip().split("|")[2]) for l in f if l.strip()]
    items = [it for it in items if os.path.exists(os.path.join(args.duration_dir, it[0] + ".npy"))]
    val_items, train_items = items[:256], items[256:]

    if rank == 0 and not os.path.exists(os.path.join(args.feature_dir, "stats.json")):
        extract_features(args, items)
    dist.barrier()
    with open(os.path.join(args.feature_dir, "stats.json")) as f:
        stats = json.load(f)

    train_ds, val_ds = FS2Dataset(train_items, args, stats), FS2Dataset(val_items, args, stats)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), args.batch_size,
                        shuffle=False, collate_fn=collate, num_workers=2)

    model = FastSpeech2(len(symbols), args.n_mels, args.n_bins, stats).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) ** -0.5, (s + 1) * args.warmup ** -1.5) * args.warmup ** 0.5)
    step, epoch = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        step, epoch = ckpt["step"], ckpt["epoch"]
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    writer = SummaryWriter(args.out_dir) if rank == 0 else None
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        model.train()
        for phones, src_lens, mels, mel_lens, pitch, energy, dur in train_dl:
            phones, src_lens, mels = phones.to(device), src_lens.to(device), mels.to(device)
            pitch, energy, dur = pitch.to(device), energy.to(device), dur.to(device)
            out = model(phones, src_lens, dur, pitch, energy)
            loss, parts = fs2_loss(out, mels, pitch, energy, dur)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                dist.all_reduce(parts, op=dist.ReduceOp.AVG)
                if rank == 0:
                    for name, v in zip(["mel", "duration", "pitch", "energy"], parts.tolist()):
                        writer.add_scalar(f"train/{name}", v, step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

            if step % args.val_every == 0:
                model.eval()
                tot = torch.zeros(5, device=device)
                with torch.no_grad():
                    for b in val_dl:
                        ph, sl, m, ml, p, e, d = [t.to(device) for t in b]
                        _, vparts = fs2_loss(model.module(ph, sl, d, p, e), m, p, e, d)
                        tot[:4] += vparts * ph.size(0)
                        tot[4] += ph.size(0)
                dist.all_reduce(tot)
                if rank == 0:
                    for name, v in zip(["mel", "duration", "pitch", "energy"], (tot[:4] / tot[4]).tolist()):
                        writer.add_scalar(f"val/{name}", v, step)
                    with torch.no_grad():
                        mel_pred = model.module(ph[:1], sl[:1])[0][0]
                    writer.add_image("val/mel_pred", mel_pred.T.flip(0).unsqueeze(0).cpu(), step)
                model.train()

            if step % args.save_every == 0 and rank == 0:
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(args.out_dir, f"fs2_{step}.pt"))
            if step >= args.max_steps:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
