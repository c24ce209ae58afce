"""Multi-dataset audio classification with a CNN14-style log-mel trunk.

ESC-50 (environmental sounds), UrbanSound8K, GTZAN (genre) and NSynth
(instrument family) each keep their own loader and head; every step takes one
batch per dataset. Per-dataset loss weights are fixed in the config.

    torchrun --nproc_per_node=4 audio_mt.py --config configs/audio_mt.json
"""
import argparse
import json
import os
import random
import time

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

CFG = {
    "sr": 32000,
    "clip_sec": 5.0,
    "tasks": {
        "esc50": {"list": "lists/esc50_{split}.tsv", "classes": 50, "weight": 1.0},
        "us8k": {"list": "lists/us8k_{split}.tsv", "classes": 10, "weight": 1.0},
        "gtzan": {"list": "lists/gtzan_{split}.tsv", "classes": 10, "weight": 0.5},
        "nsynth": {"list": "lists/nsynth_{split}.tsv", "classes": 11, "weight": 0.5},
    },
    "batch_size": 32,
    "lr": 1e-3,
    "epochs": 80,
    "iters_per_epoch": 400,
    "ckpt_dir": "checkpoints/audio_mt",
}


class ClipList(Dataset):
    def __init__(self, list_path, sr, clip_sec, train):
        with open(list_path) as f:
            self.items = [(p, int(y)) for p, y in (l.rstrip("\n").split("\t") for l in f if l.strip())]
        self.sr, self.n, self.train = sr, int(sr * clip_sec), train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        wav, sr = sf.read(path, dtype="float32", always_2d=True)
        wav = torch.from_numpy(wav.mean(1))
        if sr != self.sr:
            wav = torchaudio.functional.resample(wav, sr, self.sr)
        if wav.numel() < self.n:
            wav = F.pad(wav, (0, self.n - wav.numel()))
        off = random.randint(0, wav.numel() - self.n) if self.train else 0
        wav = wav[off:off + self.n]
        if self.train:
            wav = wav * random.uniform(0.5, 1.5)
        return wav, y


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CNN14MT(nn.Module):
    def __init__(self, sr, task_classes):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sr, n_fft=1024, hop_length=320, n_mels=64, f_min=50, f_max=14000)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.bn0 = nn.BatchNorm2d(64)
        chans = [1, 64, 128, 256, 512, 1024, 2048]
        self.blocks = nn.ModuleList([conv_block(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.fc = nn.Linear(2048, 2048)
        self.heads = nn.ModuleDict({t: nn.Linear(2048, c) for t, c in task_classes.items()})
        self.specaug = nn.Sequential(torchaudio.transforms.FrequencyMasking(8), torchaudio.transforms.TimeMasking(64))

    def embed(self, wav):
        x = self.db(self.mel(wav)).unsqueeze(1)  # B 1 F T
        x = self.bn0(x.transpose(1, 2)).transpose(1, 2)
        if self.training:
            x = self.specaug(x)
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i < len(self.blocks) - 1:
                x = F.avg_pool2d(x, 2)
            x = F.dropout(x, 0.2, self.training)
        x = x.mean(2)
        x = x.max(-1)[0] + x.mean(-1)
        return F.relu(self.fc(F.dropout(x, 0.5, self.training)))

    def forward(self, wavs):
        sizes = [w.size(0) for w in wavs.values()]
        emb = self.embed(torch.cat(list(wavs.values()))).split(sizes)
        return {t: self.heads[t](e) for t, e in zip(wavs, emb)}


def save_checkpoint(path, net, opt, sched, epoch, acc):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "epoch": epoch, "acc": acc}, path)


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world):
    net.eval()
    c = torch.zeros(len(val_sets), 2, device=device)
    for i, (t, ds) in enumerate(val_sets.items()):
        for wav, y in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=64, num_workers=4):
            wav, y = wav.to(device), y.to(device)
            c[i, 0] += (net.heads[t](net.embed(wav)).argmax(-1) == y).sum()
            c[i, 1] += len(y)
    dist.all_reduce(c)
    net.train()
    return {t: (c[i, 0] / c[i, 1]).item() for i, t in enumerate(val_sets)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = dict(CFG)
    if args.config:
        with open(args.config) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tasks = cfg["tasks"]
    streams, val_sets = {}, {}
    for t, spec in tasks.items():
        tr = ClipList(spec["list"].format(split="train"), cfg["sr"], cfg["clip_sec"], True)
        val_sets[t] = ClipList(spec["list"].format(split="test"), cfg["sr"], cfg["clip_sec"], False)
        s = DistributedSampler(tr, shuffle=True, drop_last=True)
        dl = DataLoader(tr, batch_size=cfg["batch_size"], sampler=s, num_workers=4, pin_memory=True, drop_last=True)

        def gen(dl=dl, s=s):
            e = 0
            while True:
                s.set_epoch(e)
                yield from dl
                e += 1
        streams[t] = gen()

    net = CNN14MT(cfg["sr"], {t: s["classes"] for t, s in tasks.items()})
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] * cfg["iters_per_epoch"], eta_min=1e-5)
    weights = {t: s["weight"] for t, s in tasks.items()}

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start = ck["epoch"] + 1

    best = 0.0
    for epoch in range(start, cfg["epochs"]):
        model.train()
        t0 = time.time()
        meter = torch.zeros(len(tasks), device=device)
        for it in range(cfg["iters_per_epoch"]):
            batch = {t: next(streams[t]) for t in tasks}
            wavs = {t: b[0].to(device, non_blocking=True) for t, b in batch.items()}
            ys = {t: b[1].to(device, non_blocking=True) for t, b in batch.items()}
            out = model(wavs)
            losses = torch.stack([F.cross_entropy(out[t], ys[t]) for t in tasks])
            loss = sum(weights[t] * l for t, l in zip(tasks, losses))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            meter += losses.detach()

        dist.all_reduce(meter, op=dist.ReduceOp.AVG)
        acc = evaluate(net, val_sets, device, rank, world)
        mean_acc = sum(acc.values()) / len(acc)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) loss " +
                  " ".join(f"{t}={v / cfg['iters_per_epoch']:.3f}" for t, v in zip(tasks, meter.tolist())) +
                  f" | acc {acc} mean {mean_acc:.4f}", flush=True)

        save_checkpoint(os.path.join(cfg["ckpt_dir"], "last.pt"), net, opt, sched, epoch, acc)
        if mean_acc > best:
            best = mean_acc
            save_checkpoint(os.path.join(cfg["ckpt_dir"], "best.pt"), net, opt, sched, epoch, acc)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
