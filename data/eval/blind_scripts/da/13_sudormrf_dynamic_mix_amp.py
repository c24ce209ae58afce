"""SuDoRM-RF separation with dynamic mixing of LibriSpeech utterances, fp16 AMP, multi-GPU.

    torchrun --standalone --nproc_per_node=8 13_sudormrf_dynamic_mix_amp.py \
        --speech_root /data/LibriSpeech/train-clean-360 --dev_csv /data/Libri2Mix/wav8k/min/metadata/mixture_dev_mix_clean.csv
"""
import argparse
import csv
import datetime
import glob
import itertools
import json
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SR = 8000


def build_index(speech_root, out_file, min_sec):
    entries = []
    for path in sorted(glob.glob(os.path.join(speech_root, "*", "*", "*.flac"))):
        info = sf.info(path)
        if info.duration >= min_sec:
            entries.append({"path": path, "spk": path.split(os.sep)[-3], "frames": info.frames, "sr": info.samplerate})
    tmp = out_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f)
    os.replace(tmp, out_file)


class OnTheFlyMix(Dataset):
    def __init__(self, index, n_items, segment=3.0):
        self.index = index
        self.n_items = n_items
        self.seg = int(segment * SR)
        by_spk = {}
        for i, e in enumerate(index):
            by_spk.setdefault(e["spk"], []).append(i)
        self.by_spk = by_spk
        self.speakers = sorted(by_spk)

    def __len__(self):
        return self.n_items

    def _load(self, e):
        native_seg = int(self.seg * e["sr"] / SR)
        o = random.randint(0, max(0, e["frames"] - native_seg))
        x, _ = sf.read(e["path"], start=o, frames=native_seg, dtype="float32")
        x = torchaudio.functional.resample(torch.from_numpy(x), e["sr"], SR)
        return F.pad(x, (0, max(0, self.seg - x.numel())))[: self.seg]

    def __getitem__(self, _):
        spk = random.sample(self.speakers, 2)
        srcs = [self._load(self.index[random.choice(self.by_spk[s])]) for s in spk]
        srcs = [s / (s.std() + 1e-8) * 10 ** (random.uniform(-2.5, 2.5) / 20) for s in srcs]
        srcs = torch.stack(srcs)
        mix = srcs.sum(0)
        peak = mix.abs().max() / 0.9
        return mix / peak, srcs / peak


class DevSet(Dataset):
    def __init__(self, csv_path):
        with open(csv_path) as f:
            self.rows = list(csv.DictReader(f))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        mix = sf.read(r["mixture_path"], dtype="float32")[0]
        srcs = np.stack([sf.read(r[k], dtype="float32")[0] for k in ("source_1_path", "source_2_path")])
        return torch.from_numpy(mix), torch.from_numpy(srcs)


class ConvNormAct(nn.Sequential):
    def __init__(self, cin, cout, k, stride=1, groups=1, act=True):
        layers = [nn.Conv1d(cin, cout, k, stride, padding=(k - 1) // 2, groups=groups), nn.GroupNorm(1, cout, eps=1e-8)]
        if act:
            layers.append(nn.PReLU())
        super().__init__(*layers)


class UConvBlock(nn.Module):
    def __init__(self, out_ch=128, in_ch=512, depth=4):
        super().__init__()
        self.proj = ConvNormAct(out_ch, in_ch, 1)
        self.down = nn.ModuleList([ConvNormAct(in_ch, in_ch, 5, 1, in_ch, act=False)] +
                                  [ConvNormAct(in_ch, in_ch, 5, 2, in_ch, act=False) for _ in range(depth - 1)])
        self.final = nn.Sequential(nn.GroupNorm(1, in_ch, eps=1e-8), nn.PReLU())
        self.res = nn.Conv1d(in_ch, out_ch, 1)

    def forward(self, x):
        outs = [self.down[0](self.proj(x))]
        for layer in self.down[1:]:
            outs.append(layer(outs[-1]))
        while len(outs) > 1:
            top = outs.pop()
            outs[-1] = outs[-1] + F.interpolate(top, size=outs[-1].shape[-1], mode="nearest")
        return self.res(self.final(outs[0])) + x


class SuDORMRF(nn.Module):
    def __init__(self, n_src=2, basis=512, kernel=21, hid=128, blocks=16, depth=4):
        super().__init__()
        self.n_src, self.basis, self.stride = n_src, basis, kernel // 2
        self.pad_to = self.stride * 2 ** depth
        self.encoder = nn.Sequential(nn.Conv1d(1, basis, kernel, self.stride, padding=kernel // 2), nn.ReLU())
        self.bottleneck = nn.Sequential(nn.GroupNorm(1, basis, eps=1e-8), nn.Conv1d(basis, hid, 1))
        self.separator = nn.Sequential(*[UConvBlock(hid, basis, depth) for _ in range(blocks)])
        self.mask = nn.Sequential(nn.PReLU(), nn.Conv1d(hid, n_src * basis, 1), nn.ReLU())
        self.decoder = nn.ConvTranspose1d(n_src * basis, n_src, kernel, self.stride, padding=kernel // 2,
                                          output_padding=self.stride - 1, groups=n_src)

    def forward(self, mix):
        T = mix.size(-1)
        x = F.pad(mix, (0, (-T) % self.pad_to)).unsqueeze(1)
        w = self.encoder(x)
        m = self.mask(self.separator(self.bottleneck(w)))
        y = self.decoder(m * w.repeat(1, self.n_src, 1))
        return y[..., :T]


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
    ap.add_argument("--speech_root", required=True)
    ap.add_argument("--dev_csv", required=True)
    ap.add_argument("--exp", default="exp/sudormrf_dm")
    ap.add_argument("--items_per_epoch", type=int, default=40000)
    ap.add_argument("--global_batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--patience", type=int, default=20)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)

    index_file = os.path.join(args.exp, "speech_index.json")
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        if not os.path.exists(index_file):
            build_index(args.speech_root, index_file, min_sec=3.0)
    dist.barrier()
    with open(index_file) as f:
        index = json.load(f)

    per_gpu = args.global_batch // world
    train_set = OnTheFlyMix(index, args.items_per_epoch)
    sampler = DistributedSampler(train_set, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    dev = DevSet(args.dev_csv)
    dev_dl = DataLoader(Subset(dev, range(rank, len(dev), world)), batch_size=1, num_workers=2)

    model = DDP(SuDORMRF().to(device), device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=1 / 3)
    scaler = torch.cuda.amp.GradScaler()

    best, since_best, skipped = -float("inf"), 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for mix, srcs in train_dl:
            mix, srcs = mix.to(device, non_blocking=True), srcs.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                est = model(mix)
            loss = -pit_si_snr(est.float(), srcs).mean()
            bad = (~torch.isfinite(loss)).float()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            opt.zero_grad(set_to_none=True)
            if bad.item() > 0:
                skipped += 1
                continue
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
        sched.step()

        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for mix, srcs in dev_dl:
                mix, srcs = mix.to(device), srcs.to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    est = model.module(mix)
                gain = pit_si_snr(est.float(), srcs) - pit_si_snr(mix.unsqueeze(1).expand_as(srcs), srcs)
                acc[0] += gain.sum().double()
                acc[1] += mix.size(0)
        dist.all_reduce(acc)
        sisnri = (acc[0] / acc[1]).item()
        if sisnri > best:
            best, since_best = sisnri, 0
        else:
            since_best += 1

        if rank == 0:
            print(f"epoch {epoch}: dev SI-SNRi {sisnri:.2f} (best {best:.2f}), skipped {skipped} batches", flush=True)
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(ck, os.path.join(args.exp, "last.pt"))
            if since_best == 0:
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()
        if since_best >= args.patience:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
