#!/usr/bin/env python3
"""Fine-tune a pretrained HTDemucs on the studio multitrack set (4 stems) with DDP.

Resumable: pass --resume runs/ft_htdemucs/checkpoint.th to continue a pre-empted job.

    torchrun --nproc_per_node=4 07_demucs_finetune_resume.py --data /mnt/multitracks --out runs/ft_htdemucs
"""
import argparse
import logging
import os
import random
import sys
from pathlib import Path

import julius
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
from demucs.apply import apply_model
from demucs.pretrained import get_model
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("ft")


class StudioRemix(Dataset):
    def __init__(self, songs, sources, segment_s, samplerate, epoch_size):
        self.songs = songs
        self.sources = sources
        self.samplerate = samplerate
        self.length = int(segment_s * samplerate)
        self.epoch_size = epoch_size
        self.meta = {}
        for song in songs:
            info = torchaudio.info(str(song / f"{sources[0]}.wav"))
            self.meta[song] = (info.num_frames, info.sample_rate)

    def __len__(self):
        return self.epoch_size

    def _load(self, song, source):
        frames, sr = self.meta[song]
        need = int(self.length * sr / self.samplerate) + 1
        offset = random.randint(0, max(0, frames - need))
        wav, _ = torchaudio.load(str(song / f"{source}.wav"), frame_offset=offset, num_frames=need)
        if sr != self.samplerate:
            wav = julius.resample_frac(wav, sr, self.samplerate)
        if wav.shape[0] == 1:
            wav = wav.expand(2, -1)
        wav = wav[:, :self.length]
        return F.pad(wav, (0, self.length - wav.shape[-1]))

    def __getitem__(self, index):
        stems = []
        for source in self.sources:
            wav = self._load(random.choice(self.songs), source)
            wav = wav * random.uniform(0.25, 1.25)
            if random.random() < 0.5:
                wav = -wav
            if random.random() < 0.5:
                wav = wav.flip(0)
            stems.append(wav)
        return torch.stack(stems)


def new_sdr(ref, est, eps=1e-8):
    num = (ref ** 2).sum(dim=(-2, -1)) + eps
    den = ((ref - est) ** 2).sum(dim=(-2, -1)) + eps
    return 10 * torch.log10(num / den)


def evaluate(model, songs, sources, device, args):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    totals = torch.zeros(len(sources) + 1, device=device)
    for song in songs[rank::world]:
        refs = torch.stack([torchaudio.load(str(song / f"{s}.wav"))[0] for s in sources])
        mix = refs.sum(0)
        ref_ch = mix.mean(0)
        mean, std = ref_ch.mean(), ref_ch.std()
        with torch.no_grad():
            est = apply_model(model, ((mix - mean) / std)[None], shifts=0, split=True,
                              overlap=args.overlap, device=device, progress=False)[0]
        est = est * std + mean
        totals[:-1] += new_sdr(refs.to(device), est.to(device))
        totals[-1] += 1
    dist.all_reduce(totals)
    model.train()
    return totals[:-1] / totals[-1].clamp_min(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--pretrained", default="htdemucs")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--epoch-size", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--segment", type=float, default=7.8)
    parser.add_argument("--overlap", type=float, default=0.25)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=1)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")

    if rank == 0:
        get_model(args.pretrained)  # fetch the weights into the hub cache once
    dist.barrier()
    bag = get_model(args.pretrained)
    model = bag.models[0]
    sources = list(model.sources)
    segment = min(args.segment, float(model.segment))
    model.to(device)

    songs = sorted(p for p in args.data.iterdir() if p.is_dir())
    valid_songs = [p for p in songs if p.name.startswith("val_")]
    train_songs = [p for p in songs if not p.name.startswith("val_")]

    train_set = StudioRemix(train_songs, sources, segment, model.samplerate, args.epoch_size)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True,
                        worker_init_fn=lambda w: random.seed(torch.initial_seed() % 2 ** 31 + 1000 * rank))

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    start_epoch, best = 0, float("-inf")
    if args.resume is not None and args.resume.exists():
        pkg = torch.load(args.resume)
        model.load_state_dict(pkg["state"])
        optimizer.load_state_dict(pkg["optimizer"])
        start_epoch, best = pkg["epoch"] + 1, pkg["best"]
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    ddp = DistributedDataParallel(model, device_ids=[local_rank])
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loss_acc = torch.zeros(2, device=device)
        for i, stems in enumerate(loader):
            stems = stems.to(device, non_blocking=True)
            mix = stems.sum(1)
            mono = mix.mean(1, keepdim=True)
            mean, std = mono.mean(-1, keepdim=True), mono.std(-1, keepdim=True) + 1e-8
            est = ddp((mix - mean) / std)
            loss = F.l1_loss(est, (stems - mean[:, None]) / std[:, None])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            optimizer.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
        dist.all_reduce(loss_acc)
        logger.info("epoch %d train L1 %.4f", epoch, (loss_acc[0] / loss_acc[1]).item())

        sdr = evaluate(model, valid_songs, sources, device, args)
        logger.info("epoch %d valid nSDR %s (mean %.3f)", epoch,
                    {s: round(v, 3) for s, v in zip(sources, sdr.tolist())}, sdr.mean().item())

        if rank == 0 and (epoch + 1) % args.save_every == 0:
            best = max(best, sdr.mean().item())
            pkg = {"state": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                   "best": best, "sources": sources, "samplerate": model.samplerate}
            tmp = args.out / "checkpoint.th.tmp"
            torch.save(pkg, tmp)
            os.replace(tmp, args.out / "checkpoint.th")
            if sdr.mean().item() >= best:
                torch.save(model.state_dict(), args.out / "best.th")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
