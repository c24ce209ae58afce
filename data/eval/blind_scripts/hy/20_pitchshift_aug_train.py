"""Mono singing-voice / accompaniment separation (torchaudio Conv-TasNet) at 22.05 kHz with
pitch / tempo augmentation of the vocal stem (resampling trick, as in Demucs' RepitchedWrapper
but done with torchaudio's band-limited resampler).

    torchrun --nproc_per_node=4 20_pitchshift_aug_train.py --data /data/svs_corpus --out exp/tasnet_svs
"""
import argparse
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
import torchaudio.functional as AF
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import conv_tasnet_base

SR = 22050


class RepitchRemix(Dataset):
    def __init__(self, songs, seconds, items, repitch_prob=0.3, max_semitones=2, device="cpu"):
        self.songs, self.items = songs, items
        self.n = int(seconds * SR)
        self.repitch_prob, self.max_semitones = repitch_prob, max_semitones
        self.device = device
        self.info = {}
        for s in songs:
            meta = torchaudio.info(str(s / "vocals.wav"))
            self.info[s] = (meta.num_frames, meta.sample_rate)

    def __len__(self):
        return self.items

    def load(self, song, stem, n_out):
        frames, sr = self.info[song]
        need = int(n_out * sr / SR) + 64
        off = random.randint(0, max(0, frames - need))
        wav, _ = torchaudio.load(str(song / f"{stem}.wav"), frame_offset=off, num_frames=need)
        return wav.mean(0, keepdim=True), sr

    def __getitem__(self, i):
        voc_song, acc_song = random.choice(self.songs), random.choice(self.songs)
        factor = 1.0
        if random.random() < self.repitch_prob:
            factor = 2 ** (random.uniform(-self.max_semitones, self.max_semitones) / 12)
        voc, sr_v = self.load(voc_song, "vocals", int(self.n * factor) + 1)
        acc, sr_a = self.load(acc_song, "accompaniment", self.n)
        # resampling to SR / factor and playing back at SR shifts pitch and tempo together
        voc = AF.resample(voc.to(self.device), sr_v, int(round(SR / factor)), lowpass_filter_width=16).cpu()
        acc = AF.resample(acc.to(self.device), sr_a, SR).cpu()
        voc = F.pad(voc, (0, max(0, self.n - voc.shape[-1])))[:, :self.n] * random.uniform(0.4, 1.3)
        acc = F.pad(acc, (0, max(0, self.n - acc.shape[-1])))[:, :self.n] * random.uniform(0.4, 1.3)
        return voc + acc, torch.cat([voc, acc], 0)


def si_snr(est, ref, eps=1e-8):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    s = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps) * ref
    return 10 * torch.log10(s.pow(2).sum(-1) / ((est - s).pow(2).sum(-1) + eps) + eps)


@torch.no_grad()
def separate_song(net, mix, device, seg=SR * 10, hop=SR * 5):
    T = mix.shape[-1]
    n = max(1, -(-(T - seg) // hop) + 1)
    L = (n - 1) * hop + seg
    x = F.pad(mix, (0, L - T))
    w = torch.hann_window(seg, periodic=False).clamp_min(1e-3)
    out, norm = torch.zeros(2, L), torch.zeros(L)
    for j in range(n):
        s = j * hop
        out[:, s:s + seg] += net(x[None, :, s:s + seg].to(device))[0].cpu() * w
        norm[s:s + seg] += w
    return (out / norm)[:, :T]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("exp/tasnet_svs"))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repitch-prob", type=float, default=0.3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_songs = sorted(p for p in (args.data / "train").iterdir() if p.is_dir())
    valid_songs = sorted(p for p in (args.data / "valid").iterdir() if p.is_dir())

    net = conv_tasnet_base(num_sources=2).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=3)

    ds = RepitchRemix(train_songs, args.seconds, args.items, repitch_prob=args.repitch_prob, device=device)
    sampler = DistributedSampler(ds)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                    drop_last=True, worker_init_fn=lambda w: random.seed(torch.initial_seed() + 92821 * rank))

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    best = -float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for mix, refs in dl:
            mix, refs = mix.to(device, non_blocking=True), refs.to(device, non_blocking=True)
            est = model(mix)
            loss = -si_snr(est, refs).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(tot)

        net.eval()
        acc = torch.zeros(2, device=device)
        for song in valid_songs[rank::world]:
            voc, sr = torchaudio.load(str(song / "vocals.wav"))
            bgm, _ = torchaudio.load(str(song / "accompaniment.wav"))
            voc, bgm = AF.resample(voc.mean(0, keepdim=True), sr, SR), AF.resample(bgm.mean(0, keepdim=True), sr, SR)
            n = min(voc.shape[-1], bgm.shape[-1])
            voc, bgm = voc[:, :n], bgm[:, :n]
            est = separate_song(net, voc + bgm, device)
            acc[0] += 10 * torch.log10(voc.pow(2).sum() / (voc[0] - est[0]).pow(2).sum().clamp_min(1e-9)).item()
            acc[1] += 1
        dist.all_reduce(acc)
        net.train()
        sdr = (acc[0] / acc[1]).item()
        sched.step(sdr)

        if rank == 0:
            print(f"epoch {epoch} train -SI-SNR {(tot[0] / tot[1]).item():.3f} valid vocal SDR {sdr:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, args.out / "last.pt")
            if sdr > best:
                best = sdr
                torch.save(net.state_dict(), args.out / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
