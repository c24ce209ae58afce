"""FastSpeech2-lite with a GST reference encoder (style dropout for CFG at inference).

torchrun --nproc_per_node=4 07_tts_gst_fastspeech.py --manifest data/libritts_r/train.tsv
"""
import argparse
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class TTSConfig:
    n_phones: int = 96
    d_model: int = 256
    n_layers: int = 4
    n_mels: int = 80
    n_style_tokens: int = 10
    style_dropout: float = 0.1
    batch_size: int = 32
    lr: float = 5e-4
    epochs: int = 200
    warmup: int = 4000
    ckpt_dir: str = "ckpt/fs2_gst"


class TTSData(Dataset):
    """tsv: phone_ids(space sep) \t durations(space sep) \t path/to/mel.npy"""

    def __init__(self, manifest):
        self.items = [l.rstrip("\n").split("\t") for l in open(manifest)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ph, dur, mel_path = self.items[i]
        ph = torch.tensor([int(x) for x in ph.split()])
        dur = torch.tensor([int(x) for x in dur.split()])
        mel = torch.from_numpy(np.load(mel_path)).float()  # (T, n_mels)
        return ph, dur, mel[: int(dur.sum())]


def collate(batch):
    ph = nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True)
    dur = nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True)
    mel = nn.utils.rnn.pad_sequence([b[2] for b in batch], batch_first=True)
    mel_len = torch.tensor([b[2].size(0) for b in batch])
    return ph, dur, mel, mel_len


class ReferenceEncoder(nn.Module):
    def __init__(self, n_mels, d):
        super().__init__()
        ch = [1, 32, 32, 64, 64, 128]
        self.convs = nn.Sequential(*[
            nn.Sequential(nn.Conv2d(ch[i], ch[i + 1], 3, 2, 1), nn.GroupNorm(8, ch[i + 1]), nn.ReLU())
            for i in range(5)])
        self.gru = nn.GRU(128 * ((n_mels + 31) // 32), d, batch_first=True)

    def forward(self, mel):
        x = self.convs(mel.unsqueeze(1))  # B,C,T',F'
        x = x.permute(0, 2, 1, 3).flatten(2)
        _, h = self.gru(x)
        return h[-1]


class GST(nn.Module):
    def __init__(self, d, n_tokens):
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(n_tokens, d) * 0.3)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)

    def forward(self, ref):
        keys = torch.tanh(self.tokens).unsqueeze(0).expand(ref.size(0), -1, -1)
        out, _ = self.attn(ref.unsqueeze(1), keys, keys)
        return out.squeeze(1)


class FastSpeechGST(nn.Module):
    def __init__(self, c: TTSConfig):
        super().__init__()
        self.c = c
        self.emb = nn.Embedding(c.n_phones, c.d_model, padding_idx=0)
        layer = lambda: nn.TransformerEncoderLayer(c.d_model, 4, 4 * c.d_model, 0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer(), c.n_layers)
        self.decoder = nn.TransformerEncoder(layer(), c.n_layers)
        self.ref_enc = ReferenceEncoder(c.n_mels, c.d_model)
        self.gst = GST(c.d_model, c.n_style_tokens)
        self.null_style = nn.Parameter(torch.zeros(c.d_model))
        self.dur_pred = nn.Sequential(nn.Linear(c.d_model, 256), nn.ReLU(), nn.Linear(256, 1))
        self.mel_out = nn.Linear(c.d_model, c.n_mels)

    def style(self, ref_mel):
        if self.training and random.random() < self.c.style_dropout:
            return self.null_style.unsqueeze(0).expand(ref_mel.size(0), -1)
        return self.gst(self.ref_enc(ref_mel))

    def forward(self, ph, dur, ref_mel, max_frames):
        pad = ph == 0
        h = self.encoder(self.emb(ph), src_key_padding_mask=pad)
        h = h + self.style(ref_mel).unsqueeze(1)
        log_dur = self.dur_pred(h).squeeze(-1)
        # length regulator with ground-truth durations
        frames = [torch.repeat_interleave(h[b], dur[b], dim=0) for b in range(h.size(0))]
        x = nn.utils.rnn.pad_sequence(frames, batch_first=True)[:, :max_frames]
        frame_pad = torch.arange(x.size(1), device=x.device)[None] >= dur.sum(1, keepdim=True)
        y = self.decoder(x, src_key_padding_mask=frame_pad)
        return self.mel_out(y), log_dur


def noam(step, warmup):
    step = max(step, 1)
    return min(step / warmup, (warmup / step) ** 0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = TTSConfig()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    model = FastSpeechGST(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: noam(s, cfg.warmup))
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=dev)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    ds = TTSData(args.manifest)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
                    num_workers=6, pin_memory=True, drop_last=True)
    tb = SummaryWriter(os.path.join(cfg.ckpt_dir, "logs")) if rank == 0 else None
    step = start_epoch * len(dl)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for ph, dur, mel, mel_len in dl:
            ph, dur, mel, mel_len = ph.to(dev), dur.to(dev), mel.to(dev), mel_len.to(dev)
            mel_hat, log_dur = model(ph, dur, mel, mel.size(1))
            fmask = (torch.arange(mel.size(1), device=dev)[None] < mel_len[:, None]).unsqueeze(-1)
            mel_loss = (F.l1_loss(mel_hat, mel, reduction="none") * fmask).sum() / (fmask.sum() * cfg.n_mels)
            pmask = ph != 0
            dur_loss = F.mse_loss(log_dur[pmask], torch.log1p(dur[pmask].float()))
            loss = mel_loss + dur_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                stats = torch.stack([mel_loss.detach(), dur_loss.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tb.add_scalar("loss/mel", stats[0].item(), step)
                    tb.add_scalar("loss/dur", stats[1].item(), step)
                    tb.add_scalar("grad_norm", gn.item(), step)
                    tb.add_scalar("lr", sched.get_last_lr()[0], step)

        if rank == 0 and (epoch + 1) % 10 == 0:
            os.makedirs(cfg.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "cfg": cfg.__dict__},
                       os.path.join(cfg.ckpt_dir, f"fs2gst_{epoch + 1:04d}.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
