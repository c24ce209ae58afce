"""PSLA-style AudioSet tagger: EfficientNet-B2 + attention pooling, balanced sampling, single node.

Starts one process per visible GPU itself:
    python 08_audioset_psla_spawn.py --data-json data/full_train.json --eval-json data/eval.json \
        --weights data/full_train_weight.csv --gpus 4
"""
import argparse
import json
import math
import os
import socket

import numpy as np
import soundfile as sf
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchaudio.transforms import FrequencyMasking, MelSpectrogram, TimeMasking


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data-json", required=True)
    p.add_argument("--eval-json", required=True)
    p.add_argument("--weights", required=True, help="per-clip sampling weights (one float a line)")
    p.add_argument("--n-class", type=int, default=527)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=25, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epoch-size", type=int, default=1_000_000, help="clips drawn per epoch (all GPUs)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--exp-dir", default="exp/psla_effb2")
    return p


class JsonAudio(Dataset):
    def __init__(self, path, n_class, sr=16000, seconds=10.0):
        with open(path) as f:
            self.data = json.load(f)["data"]
        self.n_class, self.n = n_class, int(sr * seconds)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        d = self.data[i]
        wav, _ = sf.read(d["wav"], dtype="float32")
        wav = wav if wav.ndim == 1 else wav.mean(1)
        x = np.zeros(self.n, np.float32)
        x[: min(len(wav), self.n)] = wav[: self.n]
        y = np.zeros(self.n_class, np.float32)
        y[[int(k) for k in d["labels"].split(",")]] = 1.0
        return torch.from_numpy(x), torch.from_numpy(y)


class DistributedWeightedSampler(Sampler):
    """Draws the same weighted sample on every rank (seeded by epoch) and gives each rank its own slice."""

    def __init__(self, weights, num_samples, rank, world, seed=0):
        self.weights = torch.as_tensor(weights, dtype=torch.double)
        self.per_rank = num_samples // world
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        idx = torch.multinomial(self.weights, self.per_rank * self.world, replacement=True, generator=g)
        return iter(idx[self.rank::self.world].tolist())

    def __len__(self):
        return self.per_rank


class EffNetAttention(nn.Module):
    def __init__(self, n_class, heads=4):
        super().__init__()
        self.backbone = timm.create_model("efficientnet_b2", pretrained=False, in_chans=1,
                                          num_classes=0, global_pool="")
        c = self.backbone.num_features
        self.att = nn.Conv1d(c, n_class * heads, 1)
        self.cla = nn.Conv1d(c, n_class * heads, 1)
        self.head_weight = nn.Parameter(torch.full((heads,), 1.0 / heads))
        self.n_class, self.heads = n_class, heads

    def forward(self, x):                       # x: (B, 1, F, T)
        h = self.backbone(x).mean(2)            # (B, C, T')
        att = torch.sigmoid(self.att(h)).view(h.size(0), self.heads, self.n_class, -1).clamp(1e-7, 1 - 1e-7)
        cla = torch.sigmoid(self.cla(h)).view_as(att)
        att = att / att.sum(-1, keepdim=True)
        out = (att * cla).sum(-1)               # (B, heads, n_class)
        return (out * self.head_weight.view(1, -1, 1)).sum(1).clamp(1e-7, 1 - 1e-7)


class LogMel(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=128, f_min=20, f_max=8000)
        self.masks = nn.Sequential(FrequencyMasking(48, iid_masks=True), TimeMasking(192, iid_masks=True))

    @torch.no_grad()
    def forward(self, wav, augment):
        x = torch.log(self.mel(wav) + 1e-6).unsqueeze(1)
        x = (x + 4.27) / 9.14
        return self.masks(x) if augment else x


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@torch.no_grad()
def evaluate(model, frontend, loader, device, n_total):
    model.eval()
    ps, ys = [], []
    for wav, y in loader:
        ps.append(model(frontend(wav.to(device), augment=False)))
        ys.append(y.to(device))
    p, y = torch.cat(ps), torch.cat(ys)
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, p.size(0))
    pad = max(sizes) - p.size(0)
    p, y = F.pad(p, (0, 0, 0, pad)), F.pad(y, (0, 0, 0, pad))
    gp = [torch.empty_like(p) for _ in sizes]
    gy = [torch.empty_like(y) for _ in sizes]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    p = torch.cat([t[:n] for t, n in zip(gp, sizes)]).cpu().numpy()
    y = torch.cat([t[:n] for t, n in zip(gy, sizes)]).cpu().numpy()
    assert len(p) == n_total
    keep = y.sum(0) > 0
    return float(np.mean(average_precision_score(y[:, keep], p[:, keep], average=None)))


def main_worker(gpu, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=args.gpus, rank=gpu)
    device = torch.device("cuda", gpu)
    torch.manual_seed(0)

    train_set = JsonAudio(args.data_json, args.n_class)
    eval_set = JsonAudio(args.eval_json, args.n_class)
    weights = np.loadtxt(args.weights)
    assert len(weights) == len(train_set)
    sampler = DistributedWeightedSampler(weights, args.epoch_size, gpu, args.gpus)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=50, sampler=list(range(gpu, len(eval_set), args.gpus)),
                             num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(EffNetAttention(args.n_class)).to(device)
    model = DDP(model, device_ids=[gpu])
    frontend = LogMel().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * args.gpus * args.batch_size / 100,
                           weight_decay=5e-7, betas=(0.95, 0.999))
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10, 15, 20, 25], gamma=0.5)
    os.makedirs(args.exp_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (wav, y) in enumerate(train_loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(frontend(wav, augment=True))
            loss = F.binary_cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if gpu == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.5f}", flush=True)
        sched.step()

        mAP = evaluate(model.module, frontend, eval_loader, device, len(eval_set))
        if gpu == 0:
            print(f"epoch {epoch} eval mAP {mAP:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.exp_dir, f"model_{epoch}.pth"))
            if mAP > best:
                best = mAP
                torch.save(model.module.state_dict(), os.path.join(args.exp_dir, "best_audio_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_parser().parse_args()
    args.port = free_port()
    mp.spawn(main_worker, nprocs=args.gpus, args=(args))
