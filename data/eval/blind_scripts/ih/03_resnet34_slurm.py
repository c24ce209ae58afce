#!/usr/bin/env python
# ResNet34 speaker embedding (wespeaker-style) on VoxCeleb2 dev, multi-node via srun.
#
#   sbatch -N 2 --ntasks-per-node=8 --gres=gpu:8 --cpus-per-task=12 \
#       --wrap "srun python 03_resnet34_slurm.py --exp /checkpoint/$USER/r34_vox2"
#
# Every srun task is one rank; all 8 GPUs of a node are visible to each task and
# the task picks its own with SLURM_LOCALID.
import argparse
import math
import os
import random
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import torchaudio.compliance.kaldi as kaldi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/voxceleb/vox2_dev")
    p.add_argument("--eval-data", default="/datasets/voxceleb/vox1_test")
    p.add_argument("--trials", default="/datasets/voxceleb/vox1/trials/vox1_O_cleaned.kaldi")
    p.add_argument("--exp", required=True)
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for 8 GPUs x 128")
    p.add_argument("--num-frames", type=int, default=200)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--port", type=int, default=29511)
    return p.parse_args()


def setup_slurm(port):
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = nodes.decode().split()[0]
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://", world_size=world, rank=rank)
    return rank, world, local_rank


# ------------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.short(x))


class ResNet34(nn.Module):
    def __init__(self, feat_dim=80, m=32, embed_dim=256):
        super().__init__()
        self.conv1 = nn.Conv2d(1, m, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(m)
        cfg = [(m, 3, 1), (2 * m, 4, 2), (4 * m, 6, 2), (8 * m, 3, 2)]
        layers, cin = [], m
        for cout, n, stride in cfg:
            for i in range(n):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.body = nn.Sequential(*layers)
        stats_dim = 8 * m * (feat_dim // 8)
        self.seg = nn.Linear(stats_dim * 2, embed_dim)  # TSTP pooling -> embedding

    def forward(self, x):  # (B, T, F)
        x = x.transpose(1, 2).unsqueeze(1)
        x = self.body(F.relu(self.bn1(self.conv1(x))))
        x = x.flatten(1, 2)
        stats = torch.cat([x.mean(-1), torch.sqrt(x.var(-1) + 1e-7)], dim=1)
        return self.seg(stats)


class ArcMarginProduct(nn.Module):
    def __init__(self, in_dim, n_cls, scale=32.0, margin=0.2):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_cls, in_dim))
        nn.init.xavier_uniform_(self.weight)
        self.scale = scale
        self.set_margin(margin)

    def set_margin(self, margin):
        self.margin = margin
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.th, self.mm = math.cos(math.pi - margin), math.sin(math.pi - margin) * margin

    def forward(self, x, y):
        cos = F.linear(F.normalize(x), F.normalize(self.weight))
        sin = torch.sqrt((1.0 - cos.pow(2)).clamp(0, 1))
        phi = cos * self.cos_m - sin * self.sin_m
        phi = torch.where(cos > self.th, phi, cos - self.mm)
        one_hot = torch.zeros_like(cos).scatter_(1, y.unsqueeze(1), 1)
        return self.scale * (one_hot * phi + (1 - one_hot) * cos)


class Model(nn.Module):
    def __init__(self, n_spk, embed_dim):
        super().__init__()
        self.backbone = ResNet34(embed_dim=embed_dim)
        self.projection = ArcMarginProduct(embed_dim, n_spk)

    def forward(self, feats, y):
        return self.projection(self.backbone(feats), y)


# ------------------------------------------------------------------------- data
def read_kv(path):
    with open(path) as f:
        return dict(line.strip().split(maxsplit=1) for line in f)


def fbank(wav, dither=0.0):
    feats = kaldi.fbank(wav.unsqueeze(0) * (1 << 15), num_mel_bins=80, frame_length=25, frame_shift=10,
                        dither=dither, sample_frequency=16000, window_type="hamming", use_energy=False)
    return feats - feats.mean(0, keepdim=True)


class TrainSet(Dataset):
    def __init__(self, data_dir, num_frames):
        wav_scp = read_kv(os.path.join(data_dir, "wav.scp"))
        utt2spk = read_kv(os.path.join(data_dir, "utt2spk"))
        self.spk2id = {s: i for i, s in enumerate(sorted(set(utt2spk.values())))}
        self.items = [(wav_scp[u], self.spk2id[utt2spk[u]]) for u in sorted(wav_scp)]
        self.samples = (num_frames - 1) * 160 + 400

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        wav, _ = torchaudio.load(path)
        wav = wav[0]
        if wav.numel() < self.samples:
            wav = wav.repeat(self.samples // wav.numel() + 1)
        off = random.randint(0, wav.numel() - self.samples)
        return fbank(wav[off:off + self.samples], dither=1.0), y


@torch.no_grad()
def extract(backbone, utt2wav, rank, world, device):
    backbone.eval()
    out = {}
    for utt in sorted(utt2wav)[rank::world]:
        wav, _ = torchaudio.load(utt2wav[utt])
        emb = backbone(fbank(wav[0]).unsqueeze(0).to(device))
        out[utt] = emb.squeeze(0).cpu().numpy()
    shards = [None for _ in range(world)]
    dist.all_gather_object(shards, out)
    merged = {}
    for s in shards:
        merged.update(s)
    return merged


def eer(scores, labels):
    order = np.argsort(scores)
    labels = labels[order]
    n_tgt, n_non = labels.sum(), (1 - labels).sum()
    fnr = np.cumsum(labels) / n_tgt
    fpr = 1 - np.cumsum(1 - labels) / n_non
    i = np.argmin(np.abs(fnr - fpr))
    return 100 * (fnr[i] + fpr[i]) / 2


def score_trials(embs, trials_path):
    mean = np.mean(np.stack(list(embs.values())), axis=0)
    scores, labels = [], []
    for line in open(trials_path):
        a, b, lab = line.split()
        ea, eb = embs[a] - mean, embs[b] - mean
        scores.append(float(ea @ eb / (np.linalg.norm(ea) * np.linalg.norm(eb))))
        labels.append(1 if lab == "target" else 0)
    return eer(np.array(scores), np.array(labels))


# ------------------------------------------------------------------------- main
def main():
    args = parse()
    rank, world, local_rank = setup_slurm(args.port)
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_set = TrainSet(args.data, args.num_frames)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                        pin_memory=True, drop_last=True, prefetch_factor=4)
    eval_wavs = read_kv(os.path.join(args.eval_data, "wav.scp"))

    model = Model(len(train_set.spk2id), args.embed_dim).cuda()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    lr = args.lr * world * args.batch_size / (8 * 128)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    iters = len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / (6 * iters)) * 0.5 * (1 + math.cos(math.pi * s / (args.epochs * iters))))

    ckpt_path = os.path.join(args.exp, "checkpoint.pt")
    start = 0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        state = {k.replace("module.", "", 1): v for k, v in ckpt["model"].items()}
        model.module.load_state_dict(state)
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}", flush=True)
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    criterion = nn.CrossEntropyLoss()
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        # margin warm-up from 0 to 0.2 over epochs 20-40 (applied identically on every rank)
        margin = 0.2 * min(1.0, max(0.0, (epoch - 20) / 20))
        model.module.projection.set_margin(margin)
        model.train()
        tic = time.time()
        tot = torch.zeros(3, device=device)
        for i, (feats, y) in enumerate(loader):
            feats, y = feats.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(feats, y)
            loss = criterion(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum().float(),
                                torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} margin {margin:.3f} loss {tot[0] / tot[2]:.4f} acc {100 * tot[1] / tot[2]:.2f}% "
                  f"lr {sched.get_last_lr()[0]:.4f} time {time.time() - tic:.0f}s", flush=True)

        if epoch % 10 == 9 or epoch == args.epochs - 1:
            embs = extract(model.module.backbone, eval_wavs, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch} vox1-O EER {score_trials(embs, args.trials):.3f}%", flush=True)

        if rank == 0:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "spk2id": train_set.spk2id}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
