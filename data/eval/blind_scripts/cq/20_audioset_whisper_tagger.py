"""Whisper-AT-style audio tagging: a (partly frozen) Whisper encoder + attention-pooling head on AudioSet.

Log-mels are computed on the GPU with whisper.log_mel_spectrogram; clips are padded to Whisper's 30 s window.

    torchrun --nproc_per_node=8 20_audioset_whisper_tagger.py --whisper-ckpt ckpt/whisper/small.pt \
        --train-list lists/as_bal_unbal_train.txt --eval-list lists/as_eval.txt --out runs/whisper_small_at
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import whisper
from scipy.stats import norm
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("whisper_at")
NUM_CLASSES = 527


class ListDataset(Dataset):
    """Lines: /path/to/clip.flac<space>3,17,402"""

    def __init__(self, list_file):
        with open(list_file) as f:
            self.items = [l.split() for l in f if l.strip()]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, labels = self.items[i]
        wav, sr = sf.read(path, dtype="float32")
        assert sr == whisper.audio.SAMPLE_RATE, path
        if wav.ndim > 1:
            wav = wav.mean(1)
        wav = wav[: 10 * sr]
        out = np.zeros(10 * sr, np.float32)
        out[: len(wav)] = wav
        y = np.zeros(NUM_CLASSES, np.float32)
        y[[int(k) for k in labels.split(",")]] = 1.0
        return torch.from_numpy(out), torch.from_numpy(y)


class WhisperTagger(nn.Module):
    def __init__(self, ckpt_path, n_trainable_blocks):
        super().__init__()
        self.encoder = whisper.load_model(ckpt_path, device="cpu").encoder
        for p in self.encoder.parameters():
            p.requires_grad_(False)
        for blk in self.encoder.blocks[-n_trainable_blocks:]:
            for p in blk.parameters():
                p.requires_grad_(True)
        for p in self.encoder.ln_post.parameters():
            p.requires_grad_(True)
        d = self.encoder.ln_post.normalized_shape[0]
        self.att = nn.Linear(d, 1)
        self.cls = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, NUM_CLASSES))

    def forward(self, mel):
        h = self.encoder(mel)[:, :500]                 # first 10 s of the 30 s window (20 ms per frame)
        w = torch.softmax(self.att(h), dim=1)
        return self.cls((w * h).sum(1))


def to_mel(wav):
    wav = whisper.pad_or_trim(wav, whisper.audio.N_SAMPLES)
    return whisper.log_mel_spectrogram(wav)            # (B, 80, 3000), on the input's device


def spec_augment(mel, F_=20, T_=100):
    b, f, t = mel.shape
    f0 = torch.randint(0, f - F_, (b, 1, 1), device=mel.device)
    fw = torch.randint(0, F_, (b, 1, 1), device=mel.device)
    t0 = torch.randint(0, 1000 - T_, (b, 1, 1), device=mel.device)
    tw = torch.randint(0, T_, (b, 1, 1), device=mel.device)
    fr = torch.arange(f, device=mel.device).view(1, -1, 1)
    tr = torch.arange(t, device=mel.device).view(1, 1, -1)
    mask = ((fr >= f0) & (fr < f0 + fw)) | ((tr >= t0) & (tr < t0 + tw))
    return mel.masked_fill(mask, mel.mean().item())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ps, ys = [], []
    for wav, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(to_mel(wav.to(device)))
        ps.append(torch.sigmoid(logits.float()).cpu().numpy())
        ys.append(y.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(ps), np.concatenate(ys)))
    p = np.concatenate([q for q, _ in parts])
    y = np.concatenate([t for _, t in parts])
    cols = y.sum(0) > 0
    mAP = average_precision_score(y[:, cols], p[:, cols], average="macro")
    auc = roc_auc_score(y[:, cols], p[:, cols], average="macro")
    return float(mAP), float(auc), float(norm.ppf(auc) * math.sqrt(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--whisper-ckpt", required=True)
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--eval-list", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trainable-blocks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=24, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 192")
    ap.add_argument("--mixup", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=10)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    train_set, eval_set = ListDataset(args.train_list), ListDataset(args.eval_list)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(eval_set, batch_size=32, sampler=range(rank, len(eval_set), world),
                             num_workers=args.workers)

    model = WhisperTagger(args.whisper_ckpt, args.trainable_blocks).to(device)
    model = DDP(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * args.batch_size * world / 192
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-2)
    total = args.epochs * len(train_loader)
    warm = min(2000, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, step = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if np.random.rand() < args.mixup:
                lam = float(np.random.beta(10, 10))
                perm = torch.randperm(wav.size(0), device=device)
                wav, y = lam * wav + (1 - lam) * wav[perm], lam * y + (1 - lam) * y[perm]
            mel = spec_augment(to_mel(wav))
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(mel)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, l.item(), sched.get_last_lr()[0])

        mAP, auc, dp = evaluate(model.module, eval_loader, device)
        log.info("epoch %d: mAP %.4f AUC %.4f d' %.3f (%.1f min)", epoch, mAP, auc, dp, (time.time() - t0) / 60)
        if rank == 0:
            trainable = {k: v for k, v in model.module.state_dict().items()
                         if not k.startswith("encoder.") or any(k.startswith(f"encoder.blocks.{i}.") for i in
                                                                range(len(model.module.encoder.blocks) - args.trainable_blocks,
                                                                      len(model.module.encoder.blocks)))
                         or k.startswith("encoder.ln_post.")}
            torch.save({"model": trainable, "opt": opt.state_dict(), "epoch": epoch, "mAP": mAP},
                       os.path.join(args.out, "last.pt"))
            if mAP > best:
                best = mAP
                torch.save({"model": trainable, "epoch": epoch, "mAP": mAP}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
