#!/usr/bin/env python
# Keyword spotting on Google Speech Commands v2 (35 words), Slurm srun, one task per GPU.
#
#   sbatch -N 2 --ntasks-per-node=4 --gpus-per-node=4 -c 8 -t 4:00:00 \
#       --wrap "srun python kws_train.py --root /shared/datasets/speech_commands --out /shared/runs/kws"
#
# The dataset is fetched by rank 0 into --root (shared filesystem) on the first run.

import argparse
import datetime
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.datasets import SPEECHCOMMANDS

LABELS = sorted("backward bed bird cat dog down eight five follow forward four go happy house learn left marvin "
                "nine no off on one right seven sheila six stop three tree two up visual wow yes zero".split())
LABEL_IDX = {w: i for i, w in enumerate(LABELS)}


def slurm_dist_init():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    head = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                          check=True, capture_output=True, text=True).stdout.split()[0]
    os.environ.update(MASTER_ADDR=head, MASTER_PORT=str(24000 + int(os.environ["SLURM_JOB_ID"]) % 8000),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    dist.init_process_group("nccl", init_method="env://", timeout=datetime.timedelta(minutes=45))
    return rank, world, local_rank


class Collate:
    def __init__(self, sr=16000, n_mels=64):
        self.mel = torchaudio.transforms.MelSpectrogram(sample_rate=sr, n_fft=480, hop_length=160, n_mels=n_mels)
        self.sr = sr

    def __call__(self, batch):
        wavs, ys = [], []
        for wav, sr, label, *_ in batch:
            wav = wav[0, : self.sr]
            wavs.append(F.pad(wav, (0, self.sr - wav.numel())))
            ys.append(LABEL_IDX[label])
        x = torch.log(self.mel(torch.stack(wavs)) + 1e-6).unsqueeze(1)
        return x, torch.tensor(ys)


class KWSNet(nn.Module):
    def __init__(self, n_cls=len(LABELS)):
        super().__init__()
        def blk(ci, co, s):
            return nn.Sequential(nn.Conv2d(ci, co, 3, s, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU(inplace=True))
        self.features = nn.Sequential(blk(1, 64, 1), blk(64, 64, 1), blk(64, 128, 2), blk(128, 128, 1),
                                      blk(128, 256, 2), blk(256, 256, 1), blk(256, 256, 2))
        self.fc = nn.Linear(256, n_cls)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 1024")
    args = ap.parse_args()

    rank, world, local_rank = slurm_dist_init()

    if rank == 0:
        os.makedirs(args.root, exist_ok=True)
        SPEECHCOMMANDS(args.root, download=True)
    dist.barrier()

    train_ds = SPEECHCOMMANDS(args.root, subset="training")
    val_ds = SPEECHCOMMANDS(args.root, subset="validation")
    test_ds = SPEECHCOMMANDS(args.root, subset="testing")
    collate = Collate()
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    shard = lambda ds: Subset(ds, range(rank, len(ds), world))
    val_dl = DataLoader(shard(val_ds), batch_size=256, collate_fn=collate, num_workers=4)
    test_dl = DataLoader(shard(test_ds), batch_size=256, collate_fn=collate, num_workers=4)

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(KWSNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch * world / 1024
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs, steps_per_epoch=len(train_dl))

    def score(loader):
        net = model.module
        net.eval()
        c = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                c[0] += (net(x).argmax(1) == y).sum()
                c[1] += y.numel()
        dist.all_reduce(c)
        return (c[0] / c[1]).item()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} train={len(train_ds)} val={len(val_ds)} test={len(test_ds)} lr={lr:.2e}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        val_acc = score(val_dl)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val_acc {val_acc:.4f} {time.time() - t0:.0f}s", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    test_acc = score(test_dl)
    if rank == 0:
        print(f"best val {best:.4f} test {test_acc:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
