"""EfficientAT-style MobileNetV3 (mn10) on AudioSet balanced + eval, waveforms cached as a 32 kHz int16 memmap.

First run decodes the raw clips once into <cache_dir>/<split>_wav.npy and <split>_targets.npy.

    torchrun --nproc_per_node=4 13_audioset_mobilenet_cache.py --audio-root /data/audioset/raw \
        --cache-dir /scratch/audioset_cache --out runs/mn10_as20k
"""
import argparse
import csv
import os
import time

import librosa
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from models.mn.model import get_model as get_mobilenet
from models.preprocess import AugmentMelSTFT

SR = 32000
CLIP = 10 * SR


def read_split(csv_path, label_csv):
    with open(label_csv) as f:
        mid2idx = {r["mid"]: int(r["index"]) for r in csv.DictReader(f)}
    rows = []
    with open(csv_path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            ytid, start, _, mids = line.strip().split(", ", 3)
            rows.append((f"{ytid}_{float(start):.3f}", [mid2idx[m] for m in mids.strip('"').split(",")]))
    return rows, len(mid2idx)


def build_cache(rows, n_classes, audio_dir, wav_path, tgt_path):
    wavs = np.lib.format.open_memmap(wav_path, mode="w+", dtype=np.int16, shape=(len(rows), CLIP))
    targets = np.zeros((len(rows), n_classes), dtype=np.bool_)
    for i, (clip_id, labels) in enumerate(tqdm(rows, desc=os.path.basename(wav_path), mininterval=30)):
        path = os.path.join(audio_dir, clip_id + ".flac")
        try:
            y, _ = librosa.load(path, sr=SR, mono=True)
        except Exception:
            y = np.zeros(0, np.float32)        # missing / broken download: keep as silence
        y = np.clip(y[:CLIP], -1.0, 1.0)
        wavs[i, : len(y)] = (y * 32767).astype(np.int16)
        wavs[i, len(y):] = 0
        targets[i, labels] = True
    wavs.flush()
    np.save(tgt_path, targets)


class CachedAudioSet(Dataset):
    def __init__(self, split, args):
        wav_path = os.path.join(args.cache_dir, f"{split}_wav.npy")
        tgt_path = os.path.join(args.cache_dir, f"{split}_targets.npy")
        if not (os.path.exists(wav_path) and os.path.exists(tgt_path)):
            os.makedirs(args.cache_dir, exist_ok=True)
            rows, n_classes = read_split(os.path.join(args.meta_dir, f"{split}_segments.csv"), args.label_csv)
            build_cache(rows, n_classes, os.path.join(args.audio_root, split), wav_path, tgt_path)
        self.wav_path = wav_path
        self.targets = np.load(tgt_path)
        self.wavs = None

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        if self.wavs is None:
            self.wavs = np.load(self.wav_path, mmap_mode="r")
        x = self.wavs[i].astype(np.float32) / 32767.0
        return torch.from_numpy(x), torch.from_numpy(self.targets[i].astype(np.float32))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--audio-root", required=True)
    p.add_argument("--meta-dir", default="metadata")
    p.add_argument("--label-csv", default="metadata/class_labels_indices.csv")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init", default="resources/mn10_im_pytorch.pt", help="ImageNet init from EfficientAT")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=30, help="per GPU")
    p.add_argument("--lr", type=float, default=6e-4, help="for 4 GPUs x 30")
    p.add_argument("--mixup-alpha", type=float, default=0.3)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def gather_variable(t):
    n = torch.tensor([t.size(0)], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    m = int(max(s.item() for s in sizes))
    padded = torch.zeros((m,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.size(0)] = t
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(model, mel, loader, device):
    model.eval()
    mel.eval()
    preds, tgts = [], []
    for wav, y in loader:
        logits, _ = model(mel(wav.to(device)).unsqueeze(1))
        preds.append(torch.sigmoid(logits))
        tgts.append(y.to(device))
    p = gather_variable(torch.cat(preds)).cpu().numpy()
    y = gather_variable(torch.cat(tgts)).cpu().numpy()
    keep = y.sum(0) > 0
    return float(average_precision_score(y[:, keep], p[:, keep], average="macro"))


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_set = CachedAudioSet("balanced_train", args)
    eval_set = CachedAudioSet("eval", args)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=64, sampler=range(rank, len(eval_set), world),
                             num_workers=args.workers)

    mel = AugmentMelSTFT(n_mels=128, sr=SR, win_length=800, hopsize=320, n_fft=1024,
                         freqm=48, timem=192, fmin=0.0, fmax=None, fmin_aug_range=10, fmax_aug_range=2000).to(device)
    model = get_mobilenet(width_mult=1.0, pretrained_name=None, num_classes=527)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = {k: v for k, v in sd.items() if not k.startswith("classifier.")}
        model.load_state_dict(sd, strict=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * world * args.batch_size / 120
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=0.0)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1,
                                                anneal_strategy="linear")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        mel.train()
        t0 = time.time()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = mel(wav).unsqueeze(1)
            if args.mixup_alpha > 0:
                lam = torch.distributions.Beta(args.mixup_alpha, args.mixup_alpha).sample((x.size(0),)).to(device)
                lam = torch.maximum(lam, 1 - lam)
                perm = torch.randperm(x.size(0), device=device)
                x = x * lam.view(-1, 1, 1, 1) + x[perm] * (1 - lam.view(-1, 1, 1, 1))
                y = y * lam.view(-1, 1) + y[perm] * (1 - lam.view(-1, 1))
            logits, _ = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        mAP = evaluate(model.module, mel, eval_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: mAP {mAP:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if mAP > best:
                best = mAP
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
