"""ECAPA-TDNN speaker embedding training on VoxCeleb2-dev with AAM-softmax.
EER is measured on the VoxCeleb1-O trial list after each epoch.

    torchrun --standalone --nproc_per_node=8 13_ecapa_speaker_verification.py \
        --train-list lists/vox2_dev.csv --trials lists/vox1_O.txt --vox1-root /data/vox1/wav
"""
import argparse
import os
import random

import deepspeed
import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import roc_curve
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-list", required=True, help="csv with columns path,speaker")
    p.add_argument("--trials", required=True)
    p.add_argument("--vox1-root", required=True)
    p.add_argument("--seg-sec", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--margin", type=float, default=0.2)
    p.add_argument("--scale", type=float, default=30.0)
    p.add_argument("--exp", default="exp/ecapa512")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class VoxTrain(Dataset):
    def __init__(self, csv, seg_sec):
        df = pd.read_csv(csv)
        self.paths = df["path"].tolist()
        self.speakers = sorted(df["speaker"].unique())
        spk2id = {s: i for i, s in enumerate(self.speakers)}
        self.labels = [spk2id[s] for s in df["speaker"]]
        self.seg = int(seg_sec * 16000)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        info = sf.info(self.paths[i])
        n = info.frames
        start = random.randint(0, max(0, n - self.seg))
        wav, _ = sf.read(self.paths[i], start=start, frames=self.seg, dtype="float32")
        if len(wav) < self.seg:
            wav = np.pad(wav, (0, self.seg - len(wav)), mode="wrap")
        return torch.from_numpy(wav), self.labels[i]


class EvalUtts(Dataset):
    def __init__(self, root, utts):
        self.root, self.utts = root, utts

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        wav, _ = sf.read(os.path.join(self.root, self.utts[i]), dtype="float32")
        return torch.from_numpy(wav), i


class Fbank(nn.Module):
    """Log-mel features with per-utterance mean normalisation; runs in fp32 outside the engine."""

    def __init__(self, n_mels=80):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400,
                                                        hop_length=160, n_mels=n_mels)

    @torch.no_grad()
    def forward(self, wav):
        x = (self.mel(wav) + 1e-6).log()
        return (x - x.mean(-1, keepdim=True)).to(torch.bfloat16)


class SEBlock(nn.Module):
    def __init__(self, c, r=8):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(c, c // r), nn.ReLU(), nn.Linear(c // r, c), nn.Sigmoid())

    def forward(self, x):
        return x * self.fc(x.mean(-1)).unsqueeze(-1)


class TDNNBlock(nn.Module):
    def __init__(self, c, k, d):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(c, c, k, dilation=d, padding=d * (k - 1) // 2),
                                 nn.ReLU(), nn.BatchNorm1d(c), SEBlock(c))

    def forward(self, x):
        return x + self.net(x)


class ECAPA(nn.Module):
    def __init__(self, n_mels=80, c=512, emb=192):
        super().__init__()
        self.inp = nn.Sequential(nn.Conv1d(n_mels, c, 5, padding=2), nn.ReLU(), nn.BatchNorm1d(c))
        self.blocks = nn.ModuleList([TDNNBlock(c, 3, d) for d in (2, 3, 4)])
        self.mfa = nn.Conv1d(3 * c, 1536, 1)
        self.att = nn.Sequential(nn.Conv1d(1536, 128, 1), nn.Tanh(), nn.Conv1d(128, 1536, 1))
        self.bn = nn.BatchNorm1d(3072)
        self.fc = nn.Linear(3072, emb)

    def forward(self, feats):
        x = self.inp(feats)
        outs = []
        for blk in self.blocks:
            x = blk(x)
            outs.append(x)
        x = F.relu(self.mfa(torch.cat(outs, 1)))
        w = torch.softmax(self.att(x), dim=-1)
        mu = (x * w).sum(-1)
        sg = ((x ** 2) * w).sum(-1).sub(mu ** 2).clamp(min=1e-4).sqrt()
        return self.fc(self.bn(torch.cat([mu, sg], 1)))


class AAMSoftmax(nn.Module):
    def __init__(self, emb, n_cls, m, s):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_cls, emb) * 0.01)
        self.m, self.s = m, s

    def forward(self, x, y):
        cos = F.linear(F.normalize(x.float()), F.normalize(self.w.float()))
        theta = torch.acos(cos.clamp(-1 + 1e-7, 1 - 1e-7))
        logits = torch.where(F.one_hot(y, cos.size(1)).bool(), torch.cos(theta + self.m), cos) * self.s
        return F.cross_entropy(logits, y)


class SpeakerNet(nn.Module):
    def __init__(self, n_spk, margin, scale):
        super().__init__()
        self.encoder = ECAPA()
        self.head = AAMSoftmax(192, n_spk, margin, scale)

    def forward(self, feats, labels=None):
        emb = self.encoder(feats)
        return emb if labels is None else self.head(emb, labels)


def compute_eer(scores, labels):
    fpr, tpr, _ = roc_curve(labels, scores)
    fnr = 1 - tpr
    idx = np.nanargmin(np.abs(fnr - fpr))
    return (fpr[idx] + fnr[idx]) / 2


@torch.no_grad()
def evaluate_eer(engine, fbank, trials, root, device):
    engine.eval()
    utts = sorted({u for _, a, b in trials for u in (a, b)})
    ds = EvalUtts(root, utts)
    loader = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds, shuffle=False), num_workers=4)
    local = {}
    for wav, idx in loader:
        local[utts[idx.item()]] = F.normalize(engine(fbank(wav.to(device))).float(), dim=-1).cpu()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    engine.train()
    if dist.get_rank() != 0:
        return None
    embs = {k: v for part in gathered for k, v in part.items()}
    scores = [float((embs[a] * embs[b]).sum()) for _, a, b in trials]
    return compute_eer(np.array(scores), np.array([int(t) for t, _, _ in trials]))


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    rank = dist.get_rank()

    train_set = VoxTrain(args.train_list, args.seg_sec)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    with open(args.trials) as f:
        trials = [line.split() for line in f if line.strip()]

    model = SpeakerNet(len(train_set.speakers), args.margin, args.scale)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "weight_decay": 2e-5}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": args.lr, "warmup_num_steps": 2000,
                                 "total_num_steps": len(loader) * args.epochs}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 500,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    fbank = Fbank().to(device)

    best_eer = 1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (wav, spk) in enumerate(loader):
            feats = fbank(wav.to(device, non_blocking=True))
            loss = engine(feats, spk.to(device, non_blocking=True))
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} aam-loss {loss.item():.3f}", flush=True)

        eer = evaluate_eer(engine, fbank, trials, args.vox1_root, device)
        engine.save_checkpoint(args.exp, tag=f"epoch{epoch}", client_state={"epoch": epoch})
        if rank == 0:
            print(f"epoch {epoch}: Vox1-O EER {eer * 100:.3f}%", flush=True)
            if eer < best_eer:
                best_eer = eer
                enc = {k: v.float().cpu() for k, v in engine.module.encoder.state_dict().items()}
                torch.save(enc, os.path.join(args.exp, "ecapa_best_encoder.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
