"""ECAPA-TDNN speaker embedding training with additive angular margin softmax.

Launch with torchrun; the config is a small YAML file.
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from sklearn.metrics import roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# ----------------------------------------------------------------------------- model
class SEBlock(nn.Module):
    def __init__(self, channels, bottleneck=128):
        super().__init__()
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool1d(1),
            nn.Conv1d(channels, bottleneck, 1), nn.ReLU(),
            nn.Conv1d(bottleneck, channels, 1), nn.Sigmoid(),
        )

    def forward(self, x):
        return x * self.se(x)


class Res2Block(nn.Module):
    def __init__(self, channels, kernel_size, dilation, scale=8):
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.conv1 = nn.Sequential(nn.Conv1d(channels, channels, 1), nn.ReLU(), nn.BatchNorm1d(channels))
        self.convs = nn.ModuleList([
            nn.Sequential(nn.Conv1d(width, width, kernel_size, dilation=dilation,
                                    padding=dilation * (kernel_size // 2)),
                          nn.ReLU(), nn.BatchNorm1d(width))
            for _ in range(scale - 1)
        ])
        self.conv3 = nn.Sequential(nn.Conv1d(channels, channels, 1), nn.ReLU(), nn.BatchNorm1d(channels))
        self.se = SEBlock(channels)

    def forward(self, x):
        residual = x
        out = self.conv1(x)
        splits = torch.chunk(out, self.scale, dim=1)
        ys, sp = [splits[0]], None
        for i, conv in enumerate(self.convs):
            sp = splits[i + 1] if sp is None else sp + splits[i + 1]
            sp = conv(sp)
            ys.append(sp)
        out = self.conv3(torch.cat(ys, dim=1))
        return self.se(out) + residual


class AttentiveStatsPool(nn.Module):
    def __init__(self, channels, attn_dim=128):
        super().__init__()
        self.attn = nn.Sequential(
            nn.Conv1d(channels * 3, attn_dim, 1), nn.Tanh(), nn.Conv1d(attn_dim, channels, 1))

    def forward(self, x):
        t = x.size(-1)
        mean = x.mean(-1, keepdim=True).expand(-1, -1, t)
        std = x.var(-1, keepdim=True).clamp(min=1e-5).sqrt().expand(-1, -1, t)
        w = torch.softmax(self.attn(torch.cat([x, mean, std], dim=1)), dim=-1)
        mu = (x * w).sum(-1)
        sg = ((x ** 2) * w).sum(-1).sub(mu ** 2).clamp(min=1e-5).sqrt()
        return torch.cat([mu, sg], dim=1)


class ECAPA(nn.Module):
    def __init__(self, n_mels=80, channels=512, emb_dim=192):
        super().__init__()
        self.layer0 = nn.Sequential(nn.Conv1d(n_mels, channels, 5, padding=2), nn.ReLU(), nn.BatchNorm1d(channels))
        self.blocks = nn.ModuleList([Res2Block(channels, 3, d) for d in (2, 3, 4)])
        self.mfa = nn.Conv1d(channels * 3, 1536, 1)
        self.pool = AttentiveStatsPool(1536)
        self.bn_pool = nn.BatchNorm1d(3072)
        self.fc = nn.Linear(3072, emb_dim)
        self.bn_emb = nn.BatchNorm1d(emb_dim)

    def forward(self, feats):                       # feats: (B, n_mels, T)
        x = self.layer0(feats)
        outs = []
        for blk in self.blocks:
            x = blk(x)
            outs.append(x)
        x = F.relu(self.mfa(torch.cat(outs, dim=1)))
        x = self.bn_pool(self.pool(x))
        return self.bn_emb(self.fc(x))


class AAMSoftmax(nn.Module):
    def __init__(self, emb_dim, n_classes, margin=0.2, scale=30.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_classes, emb_dim))
        nn.init.xavier_normal_(self.weight)
        self.m, self.s = margin, scale
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.th, self.mm = math.cos(math.pi - margin), math.sin(math.pi - margin) * margin

    def forward(self, emb, labels):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        sine = (1.0 - cosine.pow(2)).clamp(0, 1).sqrt()
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = F.one_hot(labels, cosine.size(1)).to(cosine.dtype)
        logits = self.s * (one_hot * phi + (1.0 - one_hot) * cosine)
        return F.cross_entropy(logits, labels), (cosine.argmax(1) == labels).float().mean()


class SpeakerTrainer(nn.Module):
    """Embedding network and classification head in one module so DDP syncs both."""

    def __init__(self, cfg, n_speakers):
        super().__init__()
        self.fbank = torchaudio.transforms.MelSpectrogram(
            sample_rate=16000, n_fft=512, win_length=400, hop_length=160, n_mels=cfg["n_mels"])
        self.encoder = ECAPA(cfg["n_mels"], cfg["channels"], cfg["emb_dim"])
        self.head = AAMSoftmax(cfg["emb_dim"], n_speakers, cfg["margin"], cfg["scale"])

    def features(self, wav):
        with torch.no_grad():
            x = (self.fbank(wav) + 1e-6).log()
            return x - x.mean(dim=-1, keepdim=True)

    def forward(self, wav, labels):
        return self.head(self.encoder(self.features(wav)), labels)


# ----------------------------------------------------------------------------- data
class VoxTrain(Dataset):
    def __init__(self, list_file, root, seg_sec=2.0):
        rows = [l.split() for l in open(list_file)]
        spks = sorted({spk for spk, _ in rows})
        self.spk2id = {s: i for i, s in enumerate(spks)}
        self.items = [(os.path.join(root, path), self.spk2id[spk]) for spk, path in rows]
        self.seg = int(seg_sec * 16000)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        wav, _ = torchaudio.load(path)
        wav = wav[0]
        if wav.numel() <= self.seg:
            wav = F.pad(wav, (0, self.seg - wav.numel() + 1), mode="constant")
        start = random.randint(0, wav.numel() - self.seg)
        return wav[start:start + self.seg], label


def compute_eer(scores, labels):
    fpr, tpr, _ = roc_curve(labels, scores, pos_label=1)
    fnr = 1 - tpr
    idx = np.nanargmin(np.abs(fnr - fpr))
    return float((fpr[idx] + fnr[idx]) / 2)


@torch.no_grad()
def evaluate(net, trials_file, wav_root, rank, world_size, device):
    """Each rank embeds a strided slice of the test utterances; rank 0 scores."""
    trials = [l.split() for l in open(trials_file)]
    utts = sorted({t[1] for t in trials} | {t[2] for t in trials})
    net.eval()
    local = {}
    for utt in utts[rank::world_size]:
        wav, _ = torchaudio.load(os.path.join(wav_root, utt))
        emb = net.encoder(net.features(wav[:1].to(device)))
        local[utt] = F.normalize(emb, dim=1).squeeze(0).cpu()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    net.train()

    eer = [None]
    if rank == 0:
        embs = {k: v for part in gathered for k, v in part.items()}
        scores = [float(embs[a] @ embs[b]) for _, a, b in trials]
        labels = [int(t[0]) for t in trials]
        eer[0] = compute_eer(np.array(scores), np.array(labels))
    dist.broadcast_object_list(eer, src=0)
    return eer[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="conf/ecapa_c512.yaml")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"])

    train_set = VoxTrain(cfg["train_list"], cfg["train_root"], cfg["seg_sec"])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True, seed=cfg["seed"])
    loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=sampler,
                        num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                        persistent_workers=True)

    net = SpeakerTrainer(cfg, len(train_set.spk2id))
    # per-GPU batches are small, keep BN statistics global
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=2e-5)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=2)

    start_epoch, best_eer = 0, 1.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_eer = ckpt["epoch"] + 1, ckpt["best_eer"]

    os.makedirs(cfg["exp_dir"], exist_ok=True)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for step, (wav, label) in enumerate(loader):
            wav, label = wav.to(device, non_blocking=True), label.to(device, non_blocking=True)
            loss, acc = model(wav, label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), acc.detach()])
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} it {step}/{len(loader)} loss {loss.item():.3f} acc {acc.item():.3f}", flush=True)
        dist.all_reduce(loss_sum)
        loss_sum /= world_size * len(loader)

        eer = evaluate(model.module, cfg["trials"], cfg["test_root"], rank, world_size, device)
        scheduler.step(eer)
        if rank == 0:
            print(f"== epoch {epoch} loss {loss_sum[0]:.3f} acc {loss_sum[1]:.3f} EER {eer * 100:.2f}%", flush=True)
            best_eer = min(best_eer, eer)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_eer": best_eer},
                       os.path.join(cfg["exp_dir"], f"epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
