"""Noisy 2-speaker separation with torchaudio's Conv-TasNet, trained on mixtures drawn on the fly from
LibriSpeech train-clean-360 and WHAM! noise, validated on Libri2Mix dev (mix_both).

  torchrun --standalone --nproc_per_node=8 15_tasnet_librispeech_wham_dm.py \
      --librispeech /data/LibriSpeech/train-clean-360 --wham /data/wham_noise/tr \
      --dev_csv /data/Libri2Mix/wav16k/min/metadata/mixture_dev_mix_both.csv --cache_dir cache/dm16k
"""
import argparse
import csv
import glob
import itertools
import json
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SR = 16000


def load_or_build_index(files, cache_path, min_frames):
    if os.path.isfile(cache_path):
        with open(cache_path) as f:
            return json.load(f)
    index = {}
    for path in files:
        n = sf.info(path).frames
        if n >= min_frames:
            index[path] = n
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    with open(cache_path, "w") as f:
        json.dump(index, f)
    return index


class SpeechNoiseMixer(Dataset):
    def __init__(self, speech_index, noise_index, length, segment_s=3.0, snr_range=(-5.0, 5.0)):
        self.seg = int(segment_s * SR)
        self.speech = sorted(speech_index.items())
        self.noise = sorted(noise_index.items())
        self.spk_of = [os.path.basename(p).split("-")[0] for p, _ in self.speech]
        self.length = length
        self.snr_range = snr_range

    def __len__(self):
        return self.length

    def _crop(self, path, frames):
        o = random.randint(0, frames - self.seg)
        x = sf.read(path, start=o, frames=self.seg, dtype="float32")[0]
        return x[:, 0] if x.ndim > 1 else x

    def __getitem__(self, idx):
        i = random.randrange(len(self.speech))
        j = random.randrange(len(self.speech))
        while self.spk_of[j] == self.spk_of[i]:
            j = random.randrange(len(self.speech))
        s1, s2 = self._crop(*self.speech[i]), self._crop(*self.speech[j])
        s2 = s2 * np.sqrt((s1 ** 2).mean() / ((s2 ** 2).mean() + 1e-8)) * 10 ** (random.uniform(-5, 5) / 20)
        noise = self._crop(*random.choice(self.noise))
        snr = random.uniform(*self.snr_range)
        speech_pow = ((s1 + s2) ** 2).mean()
        noise = noise * np.sqrt(speech_pow / ((noise ** 2).mean() * 10 ** (snr / 10) + 1e-8))
        mix = s1 + s2 + noise
        scale = 0.9 / max(np.abs(mix).max(), 0.9)
        srcs = np.stack([s1, s2]) * scale
        return torch.from_numpy((mix * scale).astype(np.float32)), torch.from_numpy(srcs.astype(np.float32))


class Libri2MixDev(Dataset):
    def __init__(self, csv_path):
        with open(csv_path) as f:
            self.rows = list(csv.DictReader(f))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        mix = sf.read(r["mixture_path"], dtype="float32")[0]
        s = np.stack([sf.read(r["source_1_path"], dtype="float32")[0], sf.read(r["source_2_path"], dtype="float32")[0]])
        return torch.from_numpy(mix), torch.from_numpy(s)


def si_snr(e, r, eps=1e-8):
    e, r = e - e.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
    s = (e * r).sum(-1, keepdim=True) * r / (r.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(s.pow(2).sum(-1) / ((e - s).pow(2).sum(-1) + eps) + eps)


def pit_si_snr(est, ref):
    pw = si_snr(est.unsqueeze(2), ref.unsqueeze(1))
    a = torch.arange(est.size(1), device=est.device)
    return torch.stack([pw[:, a, list(p)].mean(-1) for p in itertools.permutations(range(est.size(1)))], 1).amax(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--librispeech", required=True)
    ap.add_argument("--wham", required=True)
    ap.add_argument("--dev_csv", required=True)
    ap.add_argument("--cache_dir", default="cache/dm16k")
    ap.add_argument("--exp", default="exp/tasnet_ls_wham_dm")
    ap.add_argument("--mixtures_per_epoch", type=int, default=50000)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--segment", type=float, default=3.0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234 + rank)

    min_frames = int(args.segment * SR)
    speech_files = sorted(glob.glob(os.path.join(args.librispeech, "*", "*", "*.flac")))
    noise_files = sorted(glob.glob(os.path.join(args.wham, "*.wav")))
    t0 = time.time()
    speech_index = load_or_build_index(speech_files, os.path.join(args.cache_dir, "speech_frames.json"), min_frames)
    noise_index = load_or_build_index(noise_files, os.path.join(args.cache_dir, "noise_frames.json"), min_frames)
    if rank == 0:
        print(f"indexed {len(speech_index)} utterances, {len(noise_index)} noises in {time.time() - t0:.0f}s", flush=True)

    train_set = SpeechNoiseMixer(speech_index, noise_index, args.mixtures_per_epoch, args.segment)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    dev_set = Libri2MixDev(args.dev_csv)
    dev_dl = DataLoader(Subset(dev_set, range(rank, len(dev_set), world)), batch_size=1, num_workers=2)

    model = torchaudio.models.ConvTasNet(num_sources=2, enc_kernel_size=16, enc_num_feats=512,
                                         msk_num_feats=128, msk_num_hidden_feats=512, msk_num_layers=8,
                                         msk_num_stacks=3, msk_activate="relu").to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=4)
    best = -float("inf")
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(2, device=device)
        for mix, srcs in train_dl:
            mix, srcs = mix.to(device, non_blocking=True), srcs.to(device, non_blocking=True)
            est = model(mix.unsqueeze(1))
            loss = -pit_si_snr(est, srcs).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        dev_acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for mix, srcs in dev_dl:
                mix, srcs = mix.to(device), srcs.to(device)
                est = model.module(mix.unsqueeze(1))
                gain = pit_si_snr(est, srcs) - pit_si_snr(mix.unsqueeze(1).expand_as(srcs), srcs)
                dev_acc += torch.stack([gain.sum().double(), torch.ones((), device=device, dtype=torch.float64)])
        dist.all_reduce(stats)
        dist.all_reduce(dev_acc)
        dev_sisnri = (dev_acc[0] / dev_acc[1]).item()
        sched.step(dev_sisnri)

        if rank == 0:
            print(f"epoch {epoch}  train {(stats[0] / stats[1]).item():.3f}  dev SI-SNRi {dev_sisnri:.2f}  "
                  f"lr {opt.param_groups[0]['lr']:.1e}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(args.exp, "last.pt"))
            if dev_sisnri > best:
                best = dev_sisnri
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
