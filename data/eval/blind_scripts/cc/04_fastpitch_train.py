"""FastPitch-style acoustic model with pitch and energy conditioning.

Expects filelists "mel_path|duration_path|pitch_path|energy_path|speaker|text" produced by
prepare_dataset.py, and is launched with torchrun.
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import wandb
from common.text import cmudict, TextProcessing


@dataclass
class HParams:
    n_mel: int = 80
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 1
    n_speakers: int = 1
    dropout: float = 0.1
    max_len: int = 2048


def parse_args():
    p = argparse.ArgumentParser(description="FastPitch training")
    p.add_argument("--dataset-path", required=True)
    p.add_argument("--training-files", required=True)
    p.add_argument("--validation-files", required=True)
    p.add_argument("--output", default="./output")
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--grad-clip", type=float, default=1000.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--variance-loss-start", type=int, default=5000,
                   help="step after which pitch/energy prediction losses are added")
    p.add_argument("--epochs-per-checkpoint", type=int, default=50)
    p.add_argument("--n-speakers", type=int, default=1)
    p.add_argument("--wandb-project", default="")
    return p.parse_args()


class TTSDataset(Dataset):
    def __init__(self, root, filelist, tp):
        with open(filelist, encoding="utf-8") as f:
            self.rows = [l.rstrip("\n").split("|") for l in f if l.strip()]
        self.root, self.tp = root, tp

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        mel_p, dur_p, pitch_p, energy_p, spk, text = self.rows[i]
        load = lambda p: torch.load(os.path.join(self.root, p), map_location="cpu")
        text = torch.LongTensor(self.tp.encode_text(text))
        return text, load(mel_p), load(dur_p).long(), load(pitch_p).float(), load(energy_p).float(), int(spk)


def collate(batch):
    batch = sorted(batch, key=lambda b: b[0].size(0), reverse=True)
    text, mel, dur, pitch, energy, spk = zip(*batch)
    pad = lambda xs: nn.utils.rnn.pad_sequence(xs, batch_first=True)
    return (pad(text), torch.LongTensor([t.size(0) for t in text]),
            pad([m.t() for m in mel]).transpose(1, 2), torch.LongTensor([m.size(1) for m in mel]),
            pad(dur), pad(pitch), pad(energy), torch.LongTensor(spk))


def len_mask(lens, max_len):
    return torch.arange(max_len, device=lens.device)[None] < lens[:, None]


class PositionalEncoding(nn.Module):
    def __init__(self, d):
        super().__init__()
        inv = 1 / (10000 ** (torch.arange(0.0, d, 2.0) / d))
        self.register_buffer("inv_freq", inv)

    def forward(self, seq_len, device):
        pos = torch.arange(seq_len, device=device, dtype=self.inv_freq.dtype)
        s = torch.ger(pos, self.inv_freq)
        return torch.cat([s.sin(), s.cos()], dim=-1)[None]


class FFTransformer(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.pos = PositionalEncoding(hp.d_model)
        layer = nn.TransformerEncoderLayer(hp.d_model, hp.n_heads, 1536, hp.dropout, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, hp.n_layers)

    def forward(self, x, mask):
        x = x + self.pos(x.size(1), x.device)
        x = self.layers(x, src_key_padding_mask=~mask)
        return x * mask.unsqueeze(-1)


class TemporalPredictor(nn.Module):
    def __init__(self, d, filt=256, k=3, dropout=0.1):
        super().__init__()
        self.layers = nn.ModuleList([nn.Conv1d(d if i == 0 else filt, filt, k, padding=k // 2) for i in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(filt) for _ in range(2)])
        self.fc = nn.Linear(filt, 1)
        self.dropout = dropout

    def forward(self, x, mask):
        x = x * mask.unsqueeze(-1)
        for conv, ln in zip(self.layers, self.norms):
            x = F.relu(conv(x.transpose(1, 2))).transpose(1, 2)
            x = F.dropout(ln(x), self.dropout, self.training)
        return self.fc(x * mask.unsqueeze(-1)).squeeze(-1)


class FastPitch(nn.Module):
    def __init__(self, n_symbols, hp):
        super().__init__()
        self.embed = nn.Embedding(n_symbols, hp.d_model, padding_idx=0)
        self.speaker_emb = nn.Embedding(hp.n_speakers, hp.d_model) if hp.n_speakers > 1 else None
        self.encoder = FFTransformer(hp)
        self.decoder = FFTransformer(hp)
        self.duration_predictor = TemporalPredictor(hp.d_model)
        self.pitch_predictor = TemporalPredictor(hp.d_model)
        self.energy_predictor = TemporalPredictor(hp.d_model)
        self.pitch_emb = nn.Conv1d(1, hp.d_model, 3, padding=1)
        self.energy_emb = nn.Conv1d(1, hp.d_model, 3, padding=1)
        self.proj = nn.Linear(hp.d_model, hp.n_mel)

    def regulate(self, x, dur, pace=1.0):
        reps = torch.round(dur.float() / pace).long()
        out = [torch.repeat_interleave(xi, r, 0) for xi, r in zip(x, reps)]
        lens = torch.LongTensor([o.size(0) for o in out]).to(x.device)
        return nn.utils.rnn.pad_sequence(out, batch_first=True), lens

    def forward(self, text, text_lens, speaker, dur_tgt=None, pitch_tgt=None, energy_tgt=None, pace=1.0):
        mask = len_mask(text_lens, text.size(1))
        x = self.embed(text)
        if self.speaker_emb is not None:
            x = x + self.speaker_emb(speaker)[:, None]
        enc = self.encoder(x, mask)
        log_dur_pred = self.duration_predictor(enc, mask)
        pitch_pred = self.pitch_predictor(enc, mask)
        energy_pred = self.energy_predictor(enc, mask)
        pitch = pitch_tgt if pitch_tgt is not None else pitch_pred
        energy = energy_tgt if energy_tgt is not None else energy_pred
        enc = enc + self.pitch_emb(pitch[:, None]).transpose(1, 2) + self.energy_emb(energy[:, None]).transpose(1, 2)
        dur = dur_tgt if dur_tgt is not None else torch.clamp(torch.exp(log_dur_pred) - 1, 0, 20)
        h, mel_lens = self.regulate(enc, dur, pace)
        dec = self.decoder(h, len_mask(mel_lens, h.size(1)))
        return self.proj(dec).transpose(1, 2), mel_lens, log_dur_pred, pitch_pred, energy_pred


def masked_mse(pred, tgt, mask):
    return ((pred - tgt) ** 2 * mask).sum() / mask.sum()


def reduce_tensor(t, world):
    rt = t.detach().clone()
    dist.all_reduce(rt)
    return rt / world


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)

    tp = TextProcessing("english_basic", ["english_cleaners_v2"])
    hp = HParams(n_speakers=args.n_speakers)
    train_ds = TTSDataset(args.dataset_path, args.training_files, tp)
    val_ds = TTSDataset(args.dataset_path, args.validation_files, tp)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, num_workers=2, collate_fn=collate)

    model = FastPitch(len(tp.symbols), hp).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (hp.d_model ** -0.5) * min((s + 1) ** -0.5, (s + 1) * args.warmup_steps ** -1.5))
    scaler = GradScaler(enabled=args.amp)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        if args.wandb_project:
            wandb.init(project=args.wandb_project, config=vars(args))

    step = 0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        for text, text_lens, mel, mel_lens, dur, pitch, energy, spk in train_loader:
            text, text_lens, mel, mel_lens = (t.to(device, non_blocking=True) for t in (text, text_lens, mel, mel_lens))
            dur, pitch, energy, spk = (t.to(device, non_blocking=True) for t in (dur, pitch, energy, spk))
            with autocast(enabled=args.amp):
                mel_out, out_lens, log_dur_pred, pitch_pred, energy_pred = model(text, text_lens, spk, dur, pitch, energy)
                tmask = len_mask(text_lens, text.size(1)).float()
                mmask = len_mask(mel_lens, mel.size(2)).float().unsqueeze(1)
                mel_loss = (F.mse_loss(mel_out[..., :mel.size(2)], mel, reduction="none") * mmask).sum() / (mmask.sum() * hp.n_mel)
                dur_loss = masked_mse(log_dur_pred, torch.log1p(dur.float()), tmask)
                loss = mel_loss + 0.1 * dur_loss
                if step >= args.variance_loss_start:
                    pitch_loss = masked_mse(pitch_pred, pitch, tmask)
                    energy_loss = masked_mse(energy_pred, energy, tmask)
                    loss = loss + 0.1 * pitch_loss + 0.1 * energy_loss

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            if step % 50 == 0:
                red_loss = reduce_tensor(loss, world).item()
                red_mel = reduce_tensor(mel_loss, world).item()
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {red_loss:.4f} mel {red_mel:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e}")
                    if args.wandb_project:
                        wandb.log({"train/loss": red_loss, "train/mel_loss": red_mel}, step=step)

        if rank == 0:
            model.eval()
            val_mel, n = 0.0, 0
            with torch.no_grad():
                for text, text_lens, mel, mel_lens, dur, pitch, energy, spk in val_loader:
                    text, text_lens, mel, mel_lens = (t.to(device) for t in (text, text_lens, mel, mel_lens))
                    dur, pitch, energy, spk = (t.to(device) for t in (dur, pitch, energy, spk))
                    mel_out, *_ = model.module(text, text_lens, spk, dur, pitch, energy)
                    mmask = len_mask(mel_lens, mel.size(2)).float().unsqueeze(1)
                    val_mel += ((F.mse_loss(mel_out[..., :mel.size(2)], mel, reduction="none") * mmask).sum()
                                / (mmask.sum() * hp.n_mel)).item() * text.size(0)
                    n += text.size(0)
            print(f"epoch {epoch} val mel loss {val_mel / n:.4f} ({time.perf_counter() - t0:.1f}s)")
            if args.wandb_project:
                wandb.log({"val/mel_loss": val_mel / n, "epoch": epoch}, step=step)
            if epoch % args.epochs_per_checkpoint == 0:
                torch.save({"epoch": epoch, "step": step, "state_dict": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                           os.path.join(args.output, f"FastPitch_checkpoint_{epoch}.pt"))
        dist.barrier()

    if rank == 0 and args.wandb_project:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
