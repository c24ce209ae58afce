#!/usr/bin/env python3
"""ResNet-221 (wespeaker definition) on VoxCeleb2, then average the last N epochs.

    torchrun --nnodes=1 --nproc_per_node=8 13_resnet_tstp_avgmodel.py \
        --data data/vox2_dev --exp exp/resnet221 --epochs 120 --num-avg 10
"""
import argparse
import glob
import logging
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import torchaudio.compliance.kaldi as kaldi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from wespeaker.models.projections import ArcMarginProduct
from wespeaker.models.resnet import ResNet221

logger = logging.getLogger("train")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/vox2_dev")
    ap.add_argument("--exp", default="exp/resnet221")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for 8 GPUs")
    ap.add_argument("--final-lr", type=float, default=5e-5)
    ap.add_argument("--warmup-epochs", type=int, default=6)
    ap.add_argument("--num-frames", type=int, default=200)
    ap.add_argument("--num-avg", type=int, default=10)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--eval-data", default="data/vox1_test")
    ap.add_argument("--trials", default="data/vox1_test/trials/vox1_O_cleaned.kaldi")
    return ap.parse_args()


class KaldiDir(Dataset):
    def __init__(self, data_dir, num_frames):
        wav = dict(l.split(maxsplit=1) for l in open(os.path.join(data_dir, "wav.scp")).read().splitlines())
        u2s = dict(l.split() for l in open(os.path.join(data_dir, "utt2spk")).read().splitlines())
        self.spk2id = {s: i for i, s in enumerate(sorted(set(u2s.values())))}
        self.items = [(wav[u], self.spk2id[u2s[u]]) for u in sorted(wav)]
        self.samples = num_frames * 160 + 240

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        wav, _ = torchaudio.load(path)
        wav = wav[0] * (1 << 15)
        if wav.numel() < self.samples:
            wav = wav.repeat(math.ceil(self.samples / wav.numel()))
        s = random.randint(0, wav.numel() - self.samples)
        feats = kaldi.fbank(wav[s:s + self.samples].unsqueeze(0), num_mel_bins=80, frame_length=25,
                            frame_shift=10, dither=1.0, sample_frequency=16000, window_type="hamming")
        return feats - feats.mean(0), y


class SpeakerModel(nn.Module):
    def __init__(self, n_spk):
        super().__init__()
        self.backbone = ResNet221(feat_dim=80, embed_dim=256, pooling_func="TSTP", two_emb_layer=False)
        self.projection = ArcMarginProduct(256, n_spk, scale=32.0, margin=0.2)

    def forward(self, feats, y):
        emb = self.backbone(feats)[-1]
        return self.projection(emb, y)


def exp_lr(epoch_f, args, world):
    base = args.lr * world / 8
    if epoch_f < args.warmup_epochs:
        return base * epoch_f / args.warmup_epochs
    t = (epoch_f - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return base * math.exp(t * math.log(args.final_lr / base))


def margin_at(epoch):
    # wespeaker margin scheduler: 0 for 20 epochs, linear to 0.2 at epoch 40
    return 0.2 * min(1.0, max(0.0, (epoch - 20) / 20))


def save_checkpoint(model, optimizer, epoch, path):
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


def average_checkpoints(paths, out):
    avg = None
    for p in paths:
        sd = torch.load(p, map_location="cpu")["model"]
        if avg is None:
            avg = {k: v.clone().double() for k, v in sd.items()}
        else:
            for k in avg:
                avg[k] += sd[k].double()
    for k in avg:
        avg[k] = (avg[k] / len(paths)).to(sd[k].dtype)
    torch.save(avg, out)


@torch.no_grad()
def evaluate_vox1(backbone, eval_dir, trials_path, device, rank, world):
    backbone.eval()
    wavs = dict(l.split(maxsplit=1) for l in open(os.path.join(eval_dir, "wav.scp")).read().splitlines())
    mine = {}
    for utt in sorted(wavs)[rank::world]:
        wav, _ = torchaudio.load(wavs[utt])
        feats = kaldi.fbank(wav * (1 << 15), num_mel_bins=80, frame_length=25, frame_shift=10,
                            dither=0.0, sample_frequency=16000, window_type="hamming")
        emb = backbone((feats - feats.mean(0)).unsqueeze(0).to(device))[-1]
        mine[utt] = torch.nn.functional.normalize(emb, dim=1)[0].cpu().numpy()
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    emb = {k: v for part in parts for k, v in part.items()}
    scores, labels = [], []
    for line in open(trials_path):
        a, b, lab = line.split()
        scores.append(float(emb[a] @ emb[b]))
        labels.append(lab == "target")
    scores, labels = np.array(scores), np.array(labels)
    thr = np.sort(scores)
    fnr = np.array([(scores[labels] < t).mean() for t in thr[::50]])
    fpr = np.array([(scores[~labels] >= t).mean() for t in thr[::50]])
    i = np.argmin(np.abs(fnr - fpr))
    return 100 * (fnr[i] + fpr[i]) / 2


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [rank %(process)d] %(message)s")

    dataset = KaldiDir(args.data, args.num_frames)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, prefetch_factor=4)

    model = SpeakerModel(len(dataset.spk2id)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss()

    os.makedirs(os.path.join(args.exp, "models"), exist_ok=True)
    start_epoch = 0
    existing = sorted(glob.glob(os.path.join(args.exp, "models", "model_*.pt")),
                      key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]))
    if existing:
        ck = torch.load(existing[-1], map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"] + 1
        logger.info("resuming from %s", existing[-1])

    n_iter = len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.module.projection.update(margin_at(epoch))
        model.train()
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for i, (feats, y) in enumerate(loader):
            lr = exp_lr(epoch + i / n_iter, args, world)
            for g in optimizer.param_groups:
                g["lr"] = lr
            feats, y = feats.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(feats, y)
            loss = criterion(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach() * y.size(0), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(y.size(0)), device=device)])
            if (i + 1) % 200 == 0:
                m = meter.clone()
                dist.all_reduce(m)
                logger.info("epoch %d [%d/%d] loss %.4f acc %.2f%% lr %.5f", epoch, i + 1, n_iter,
                            m[0] / m[2], 100 * m[1] / m[2], lr)
        dist.all_reduce(meter)
        logger.info("epoch %d done: loss %.4f acc %.2f%% time %.0fs", epoch, meter[0] / meter[2],
                    100 * meter[1] / meter[2], time.time() - tic)
        save_checkpoint(model, optimizer, epoch, os.path.join(args.exp, "models", f"model_{epoch}.pt"))
        dist.barrier()

    avg_path = os.path.join(args.exp, "models", "avg_model.pt")
    if rank == 0:
        last = [os.path.join(args.exp, "models", f"model_{e}.pt")
                for e in range(args.epochs - args.num_avg, args.epochs)]
        average_checkpoints(last, avg_path)
        logger.info("averaged %d checkpoints -> avg_model.pt", len(last))
    dist.barrier()

    model.module.load_state_dict(torch.load(avg_path, map_location="cpu"))
    eer = evaluate_vox1(model.module.backbone, args.eval_data, args.trials, device, rank, world)
    if rank == 0:
        logger.info("avg_model Vox1-O EER %.3f%%", eer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
