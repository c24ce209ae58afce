#!/usr/bin/env python
"""CNN14-style audio tagging on AudioSet (log-mel), preemptible partition.

    #SBATCH --partition=gpu-preempt
    #SBATCH --nodes=2 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=12
    #SBATCH --signal=USR1@120
    #SBATCH --requeue
    #SBATCH --open-mode=append

    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -1)
    export MASTER_PORT=$(( 15000 + SLURM_JOB_ID % 10000 ))
    srun --kill-on-bad-exit=1 python audioset_cnn.py --cfg cfg/cnn14.json

Slurm delivers SIGUSR1 to every task two minutes before the end of the
allocation; the job saves a checkpoint and requeues itself.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

preempt_requested = False


def handle_usr1(signum, frame):
    global preempt_requested
    preempt_requested = True


class AudioSetH5(Dataset):
    def __init__(self, path, clip_samples=320000):
        self.path = path
        self.clip_samples = clip_samples
        with h5py.File(path, "r") as f:
            self.n = len(f["waveform"])
        self.h5 = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        wav = self.h5["waveform"][i][: self.clip_samples].astype(np.float32) / 32768.0
        target = self.h5["target"][i].astype(np.float32)
        return torch.from_numpy(wav), torch.from_numpy(target)


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.AvgPool2d(2),
    )


class CNN14(nn.Module):
    def __init__(self, n_classes=527, sr=32000, n_mels=64):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sr, n_fft=1024, hop_length=320,
                                                        n_mels=n_mels, f_min=50, f_max=14000)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=None)
        self.bn0 = nn.BatchNorm2d(n_mels)
        chans = [1, 64, 128, 256, 512, 1024, 2048]
        self.blocks = nn.Sequential(*[conv_block(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.fc1 = nn.Linear(2048, 2048)
        self.head = nn.Linear(2048, n_classes)

    def forward(self, wav):
        with torch.autocast("cuda", enabled=False):
            x = self.db(self.mel(wav.float())).unsqueeze(1)   # B,1,M,T
        x = self.bn0(x.transpose(1, 2)).transpose(1, 2)
        x = self.blocks(x)
        x = x.mean(dim=2)
        x = x.max(dim=2).values + x.mean(dim=2)
        x = F.relu(self.fc1(F.dropout(x, 0.5, self.training)))
        return self.head(F.dropout(x, 0.5, self.training))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = json.load(open(ap.parse_args().cfg))

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    signal.signal(signal.SIGUSR1, handle_usr1)

    train_ds = AudioSetH5(cfg["train_h5"])
    eval_ds = AudioSetH5(cfg["eval_h5"])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    nw = int(os.environ.get("SLURM_CPUS_PER_TASK", 8)) - 2
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_per_gpu"], sampler=sampler,
                          num_workers=nw, pin_memory=True, drop_last=True, persistent_workers=True)
    eval_dl = DataLoader(eval_ds, batch_size=64, num_workers=nw,
                         sampler=DistributedSampler(eval_ds, shuffle=False))

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CNN14()).cuda()
    model = DDP(model, device_ids=[local])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"] * world / 8, betas=(0.9, 0.999),
                           amsgrad=True)
    scaler = torch.cuda.amp.GradScaler()

    ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        step, epoch = ck["step"], ck["epoch"]
    elif rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    def save():
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict(), "step": step, "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)

    stopped = False
    while epoch < cfg["epochs"]:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, target in train_dl:
            wav, target = wav.cuda(non_blocking=True), target.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(wav)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            step += 1
            if step % 200 == 0 and rank == 0:
                print(f"step {step} loss {loss.item():.4f} {(time.time() - t0) / 200:.3f}s/it",
                      flush=True)
                t0 = time.time()
            if preempt_requested:
                stopped = True
                break
        if stopped:
            break
        epoch += 1

        model.eval()
        preds, targets = [], []
        with torch.no_grad():
            for wav, target in eval_dl:
                preds.append(torch.sigmoid(model.module(wav.cuda())).float())
                targets.append(target.cuda())
        preds, targets = torch.cat(preds), torch.cat(targets)
        all_p = [torch.empty_like(preds) for _ in range(world)]
        all_t = [torch.empty_like(targets) for _ in range(world)]
        dist.all_gather(all_p, preds)
        dist.all_gather(all_t, targets)
        if rank == 0:
            # DistributedSampler hands out indices round-robin: interleave back
            p = torch.stack(all_p, 1).flatten(0, 1).cpu().numpy()[: len(eval_ds)]
            t = torch.stack(all_t, 1).flatten(0, 1).cpu().numpy()[: len(eval_ds)]
            mAP = average_precision_score(t, p, average="macro")
            print(f"epoch {epoch} eval mAP {mAP:.4f}", flush=True)
        save()
        dist.barrier()

    save()
    dist.barrier()
    if stopped and rank == 0:
        print(f"preempted at step {step}, requeueing job {os.environ['SLURM_JOB_ID']}", flush=True)
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
