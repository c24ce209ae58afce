"""x-vector (TDNN) speaker embedding with additive-margin softmax.
Augmentation (MUSAN noise / RIR reverb) and fbank extraction run on the GPU inside the dataset
to keep the CPU data pipeline from bottlenecking 8 GPUs.

torchrun --nproc_per_node=8 18_xvector_gpu_augment.py --train_csv lists/vox1_dev.csv \
    --musan_csv lists/musan.csv --rir_csv lists/rirs.csv --trials lists/vox1_O.txt --root /data/vox1
"""
import argparse
import csv
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SEG = 32000  # 2 s


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def load_crop(path, n, rng):
    wav, _ = sf.read(path, dtype="float32")
    if len(wav) < n:
        wav = np.pad(wav, (0, n - len(wav)), mode="wrap")
    s = rng.randint(0, len(wav) - n)
    return wav[s:s + n]


class GPUAugmentedSpeakerSet(Dataset):
    def __init__(self, rows, root, musan, rirs, device):
        self.rows, self.root = rows, root
        spks = sorted({r["spk"] for r in rows})
        self.spk2id = {s: i for i, s in enumerate(spks)}
        self.musan, self.rirs = musan, rirs
        self.device = device
        self.fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                                          n_mels=30).to(device)
        self.rng = random.Random()

    def __len__(self):
        return len(self.rows)

    def _augment(self, x):
        choice = self.rng.randint(0, 2)
        if choice == 1:
            noise = torch.from_numpy(load_crop(self.rng.choice(self.musan)["path"], SEG, self.rng)).to(self.device)
            snr = torch.tensor([self.rng.uniform(5, 20)], device=self.device)
            x = torchaudio.functional.add_noise(x[None], noise[None], snr)[0]
        elif choice == 2:
            rir, _ = sf.read(self.rng.choice(self.rirs)["path"], dtype="float32")
            rir = torch.from_numpy(rir).to(self.device)
            rir = rir / rir.norm()
            x = torchaudio.functional.fftconvolve(x, rir)[:SEG]
        return x

    def __getitem__(self, i):
        r = self.rows[i]
        x = torch.from_numpy(load_crop(os.path.join(self.root, r["path"]), SEG, self.rng)).to(self.device)
        x = self._augment(x)
        feats = (self.fbank(x) + 1e-6).log()
        feats = feats - feats.mean(-1, keepdim=True)
        return feats.cpu(), self.spk2id[r["spk"]]


class XVector(nn.Module):
    def __init__(self, n_mels=30, emb=512):
        super().__init__()
        def tdnn(i, o, k, d):
            return nn.Sequential(nn.Conv1d(i, o, k, dilation=d), nn.ReLU(), nn.BatchNorm1d(o))
        self.frame = nn.Sequential(tdnn(n_mels, 512, 5, 1), tdnn(512, 512, 3, 2), tdnn(512, 512, 3, 3),
                                   tdnn(512, 512, 1, 1), tdnn(512, 1500, 1, 1))
        self.seg6 = nn.Linear(3000, emb)
        self.bn6 = nn.BatchNorm1d(emb)

    def forward(self, x):
        h = self.frame(x)
        stats = torch.cat([h.mean(-1), h.std(-1)], dim=1)
        return self.bn6(self.seg6(stats))


class AMSoftmax(nn.Module):
    def __init__(self, emb, n_spk, m=0.2, s=30.0):
        super().__init__()
        self.W = nn.Parameter(torch.randn(emb, n_spk) * 0.01)
        self.m, self.s = m, s

    def forward(self, x, y):
        cos = F.normalize(x, dim=1) @ F.normalize(self.W, dim=0)
        logits = self.s * (cos - self.m * F.one_hot(y, cos.size(1)))
        return F.cross_entropy(logits, y), (cos.argmax(1) == y).float().mean()


class Net(nn.Module):
    def __init__(self, n_spk):
        super().__init__()
        self.xvec = XVector()
        self.loss = AMSoftmax(512, n_spk)

    def forward(self, feats, y):
        return self.loss(self.xvec(feats), y)


@torch.no_grad()
def embed_and_score(xvec, trials, root, device, rank, world):
    fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160, n_mels=30).to(device)
    utts = sorted({u for t in trials for u in t[1:]})
    mine = {}
    xvec.eval()
    for u in utts[rank::world]:
        wav, _ = sf.read(os.path.join(root, u), dtype="float32")
        f = (fbank(torch.from_numpy(wav).to(device)) + 1e-6).log()
        f = f - f.mean(-1, keepdim=True)
        mine[u] = F.normalize(xvec(f[None]), dim=1)[0].cpu()
    xvec.train()
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    emb = {k: v for d in gathered for k, v in d.items()}
    scores = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
    labels = np.array([int(l) for l, _, _ in trials])
    fpr, tpr, _ = roc_curve(labels, scores)
    i = np.nanargmin(np.abs(1 - tpr - fpr))
    return 100 * (fpr[i] + 1 - tpr[i]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_csv", required=True)
    ap.add_argument("--musan_csv", required=True)
    ap.add_argument("--rir_csv", required=True)
    ap.add_argument("--trials", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="exp/xvector")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    ds = GPUAugmentedSpeakerSet(read_csv(args.train_csv), args.root, read_csv(args.musan_csv),
                                read_csv(args.rir_csv), device)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, drop_last=True,
                        worker_init_fn=lambda wid: ds.rng.seed(torch.initial_seed() % 2 ** 32))
    with open(args.trials) as f:
        trials = [l.split() for l in f if l.strip()]

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Net(len(ds.spk2id))).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=1e-5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        meter = torch.zeros(3, device=device)
        for feats, y in loader:
            feats, y = feats.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss, acc = model(feats, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            meter += torch.stack([loss.detach(), acc.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        eer = embed_and_score(model.module.xvec, trials, args.root, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} loss {meter[0] / meter[2]:.3f} acc {meter[1] / meter[2]:.3f} EER {eer:.2f}%",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"xvector_ep{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
