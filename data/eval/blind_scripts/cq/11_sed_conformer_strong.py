"""Frame-level sound event detection on AudioSet-Strong with a CNN + Conformer encoder.

Frame targets at 40 ms; evaluation gathers all frame predictions and reports frame mAP,
clip mAP (max over frames) and segment-based F1 (1 s segments).

    torchrun --nproc_per_node=8 11_sed_conformer_strong.py --cfg configs/conformer_sed.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import Conformer
from torchaudio.transforms import AmplitudeToDB, FrequencyMasking, MelSpectrogram, TimeMasking

FRAME_HOP_S = 0.04        # model output resolution
SR = 16000


class StrongLabelSet(Dataset):
    """AudioSet-strong style TSV: segment_id, start_time_seconds, end_time_seconds, label."""

    def __init__(self, tsv, wav_dir, label_list, seconds=10.0):
        df = pd.read_csv(tsv, sep="\t")
        self.lab = {l: i for i, l in enumerate(label_list)}
        df = df[df["label"].isin(self.lab)]
        self.ids = sorted(df["segment_id"].unique())
        self.events = {k: g[["start_time_seconds", "end_time_seconds", "label"]].to_numpy()
                       for k, g in df.groupby("segment_id")}
        self.wav_dir = wav_dir
        self.n = int(SR * seconds)
        self.n_frames = int(round(seconds / FRAME_HOP_S))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        sid = self.ids[i]
        wav, _ = sf.read(os.path.join(self.wav_dir, f"{sid}.wav"), dtype="float32")
        if wav.ndim > 1:
            wav = wav.mean(1)
        wav = np.pad(wav[: self.n], (0, max(0, self.n - len(wav))))
        y = np.zeros((self.n_frames, len(self.lab)), np.float32)
        for on, off, l in self.events[sid]:
            y[int(on / FRAME_HOP_S): int(math.ceil(off / FRAME_HOP_S)), self.lab[l]] = 1.0
        return torch.from_numpy(wav), torch.from_numpy(y), i


class ConformerSED(nn.Module):
    def __init__(self, n_mels, n_classes, d_model=256, layers=6, heads=4):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 64, 3, padding=1), nn.BatchNorm2d(64), nn.GELU(), nn.AvgPool2d((2, 2)),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.GELU(), nn.AvgPool2d((2, 2)),
            nn.Conv2d(128, 128, 3, padding=1), nn.BatchNorm2d(128), nn.GELU(), nn.AvgPool2d((1, 4)),
        )
        self.proj = nn.Linear(128 * (n_mels // 16), d_model)
        self.encoder = Conformer(input_dim=d_model, num_heads=heads, ffn_dim=4 * d_model, num_layers=layers,
                                 depthwise_conv_kernel_size=31, dropout=0.1)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x):                                   # x: (B, 1, T, F), T at 10 ms
        h = self.cnn(x)                                     # (B, C, T/4, F/16)
        b, c, t, f = h.shape
        h = self.proj(h.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lengths = torch.full((b,), t, dtype=torch.long, device=h.device)
        h, _ = self.encoder(h, lengths)
        return self.head(h)                                 # frame logits (B, T/4, classes)


class LogMel(nn.Module):
    def __init__(self, n_mels):
        super().__init__()
        self.mel = MelSpectrogram(SR, n_fft=1024, win_length=400, hop_length=160, n_mels=n_mels)
        self.db = AmplitudeToDB(top_db=80)
        self.fmask, self.tmask = FrequencyMasking(16, iid_masks=True), TimeMasking(50, iid_masks=True)

    @torch.no_grad()
    def forward(self, wav, augment=False):
        x = self.db(self.mel(wav))[..., :-1].unsqueeze(1)   # (B, 1, F, 1000)
        x = (x - x.mean((2, 3), keepdim=True)) / (x.std((2, 3), keepdim=True) + 1e-5)
        if augment:
            x = self.tmask(self.fmask(x))
        return x.transpose(2, 3)


def segment_f1(pred, target, frames_per_seg=25):
    n, t, c = pred.shape
    t = t // frames_per_seg * frames_per_seg
    ps = pred[:, :t].reshape(n, -1, frames_per_seg, c).max(2)
    ts = target[:, :t].reshape(n, -1, frames_per_seg, c).max(2)
    tp = (ps & ts).sum()
    return 2 * tp / max(1, ps.sum() + ts.sum())


@torch.no_grad()
def validate(model, frontend, loader, n_clips):
    model.eval()
    probs, targets, idxs = [], [], []
    for wav, y, idx in loader:
        logits = model(frontend(wav.cuda(non_blocking=True)))
        probs.append(torch.sigmoid(logits).half().cpu())
        targets.append(y.bool())
        idxs.append(idx)
    local = (torch.cat(probs), torch.cat(targets), torch.cat(idxs))
    world = dist.get_world_size()
    gathered = []
    for t in local:
        bufs = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(bufs, t)
        gathered.append(torch.cat(bufs))
    p, y, idx = gathered
    _, keep = np.unique(idx.numpy(), return_index=True)      # drop DistributedSampler padding
    p, y = p[keep].float().numpy(), y[keep].numpy()
    assert len(p) == n_clips
    c = p.shape[-1]
    pf, yf = p.reshape(-1, c), y.reshape(-1, c)
    valid = yf.any(0)
    frame_map = average_precision_score(yf[:, valid], pf[:, valid], average="macro")
    pc, yc = p.max(1), y.max(1)
    validc = yc.any(0)
    clip_map = average_precision_score(yc[:, validc], pc[:, validc], average="macro")
    seg_f1 = segment_f1(p > 0.5, y)
    return frame_map, clip_map, float(seg_f1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    labels = [l.strip() for l in open(cfg["label_list"]) if l.strip()]
    train_set = StrongLabelSet(cfg["train_tsv"], cfg["train_wavs"], labels)
    val_set = StrongLabelSet(cfg["eval_tsv"], cfg["eval_wavs"], labels)
    bs = cfg.get("batch_size", 32)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, bs, sampler=train_sampler, num_workers=cfg.get("workers", 8),
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 32, sampler=val_sampler, num_workers=cfg.get("workers", 8), pin_memory=True)

    n_mels = cfg.get("n_mels", 64)
    model = ConformerSED(n_mels, len(labels), d_model=cfg.get("d_model", 256), layers=cfg.get("layers", 6))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])
    frontend = LogMel(n_mels).cuda()

    lr = cfg.get("lr", 5e-4) * math.sqrt(world * bs / 256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.get("wd", 1e-2))
    total = cfg.get("epochs", 100) * len(train_loader)
    warm = cfg.get("warmup_steps", 2000)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    pos_weight = torch.full((len(labels),), cfg.get("pos_weight", 3.0), device="cuda")

    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(cfg.get("epochs", 100)):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), torch.zeros(2, device="cuda")
        for wav, y, _ in train_loader:
            wav, y = wav.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(frontend(wav, augment=True))
            logits = logits.float()
            frame_loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight)
            clip_loss = F.binary_cross_entropy_with_logits(logits.max(1).values, y.max(1).values)
            loss = frame_loss + 0.5 * clip_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        dist.all_reduce(run)

        frame_map, clip_map, seg_f1 = validate(model, frontend, val_loader, len(val_set))
        if rank == 0:
            print(f"ep {epoch} loss {run[0].item() / run[1].item():.4f} frame mAP {frame_map:.4f} "
                  f"clip mAP {clip_map:.4f} segF1 {seg_f1:.4f} [{time.time() - t0:.0f}s]", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "cfg": cfg}
            torch.save(state, os.path.join(out_dir, "last.pt"))
            if frame_map > best:
                best = frame_map
                torch.save(state, os.path.join(out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
