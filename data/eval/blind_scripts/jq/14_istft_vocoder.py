"""iSTFTNet (C8C8I) vocoder: HiFi-GAN style upsampler followed by an inverse STFT head.

Log-mels are computed once into --cache_dir (npy per utterance + meta.json) and reused by
later runs.

    torchrun --nproc_per_node=4 14_istft_vocoder.py --wav_dir /data/jsut/wav --filelist filelists/jsut_train.txt \
        --cache_dir /data/cache/jsut_mel80 --config configs/istft_c8c8i.json --out exp/istft_jsut
"""
import argparse
import itertools
import json
import os
import random

import librosa
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from istftnet.models import (Generator, MultiPeriodDiscriminator, MultiScaleDiscriminator,
                             discriminator_loss, feature_loss, generator_loss)
from istftnet.stft import TorchSTFT
from meldataset import mel_spectrogram


def log_mel(wav, cfg):
    mel = librosa.feature.melspectrogram(y=wav, sr=cfg["sampling_rate"], n_fft=cfg["n_fft"],
                                         hop_length=cfg["hop_size"], win_length=cfg["win_size"],
                                         n_mels=cfg["num_mels"], fmin=cfg["fmin"], fmax=cfg["fmax"],
                                         power=1.0, center=False, pad_mode="reflect")
    return np.log(np.clip(mel, 1e-5, None)).astype(np.float32)


def prepare_cache(wav_dir, filelist, cache_dir, cfg):
    meta_path = os.path.join(cache_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            return json.load(f)
    os.makedirs(cache_dir, exist_ok=True)
    meta = []
    with open(filelist) as f:
        stems = [l.strip().split("|")[0] for l in f if l.strip()]
    pad = (cfg["n_fft"] - cfg["hop_size"]) // 2
    for stem in tqdm(stems, desc="mel cache"):
        wav, sr = sf.read(os.path.join(wav_dir, stem + ".wav"), dtype="float32")
        if sr != cfg["sampling_rate"]:
            wav = librosa.resample(wav, orig_sr=sr, target_sr=cfg["sampling_rate"])
        wav = 0.95 * wav / (np.abs(wav).max() + 1e-6)
        mel = log_mel(np.pad(wav, (pad, pad), mode="reflect"), cfg)
        np.save(os.path.join(cache_dir, stem + ".mel.npy"), mel)
        np.save(os.path.join(cache_dir, stem + ".wav.npy"), wav[: mel.shape[1] * cfg["hop_size"]])
        meta.append({"stem": stem, "frames": int(mel.shape[1])})
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return meta


class CachedSegments(Dataset):
    def __init__(self, meta, cache_dir, segment_frames, hop):
        self.items = [m for m in meta if m["frames"] >= segment_frames]
        self.cache_dir, self.seg, self.hop = cache_dir, segment_frames, hop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        stem = self.items[i]["stem"]
        mel = np.load(os.path.join(self.cache_dir, stem + ".mel.npy"), mmap_mode="r")
        wav = np.load(os.path.join(self.cache_dir, stem + ".wav.npy"), mmap_mode="r")
        start = random.randint(0, mel.shape[1] - self.seg)
        mel = np.array(mel[:, start:start + self.seg])
        wav = np.array(wav[start * self.hop:(start + self.seg) * self.hop])
        return torch.from_numpy(mel), torch.from_numpy(wav)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wav_dir", required=True)
    ap.add_argument("--filelist", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_steps", type=int, default=1_000_000)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    meta = prepare_cache(args.wav_dir, args.filelist, args.cache_dir, cfg)
    dataset = CachedSegments(meta, args.cache_dir, cfg["segment_size"] // cfg["hop_size"], cfg["hop_size"])
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["num_workers"],
                        pin_memory=True, drop_last=True)

    generator = Generator(cfg).to(device)
    stft = TorchSTFT(filter_length=cfg["gen_istft_n_fft"], hop_length=cfg["gen_istft_hop_size"],
                     win_length=cfg["gen_istft_n_fft"]).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)
    generator = DDP(generator, device_ids=[local_rank])
    mpd = DDP(mpd, device_ids=[local_rank])
    msd = DDP(msd, device_ids=[local_rank])
    optim_g = torch.optim.AdamW(generator.parameters(), cfg["learning_rate"], betas=[cfg["adam_b1"], cfg["adam_b2"]])
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()), cfg["learning_rate"],
                                betas=[cfg["adam_b1"], cfg["adam_b2"]])
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=cfg["lr_decay"])
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=cfg["lr_decay"])

    sw = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        sw = SummaryWriter(os.path.join(args.out, "logs"))

    steps, epoch = 0, 0
    while steps < args.max_steps:
        sampler.set_epoch(epoch)
        for mel, wav in loader:
            mel = mel.to(device, non_blocking=True)
            wav = wav.to(device, non_blocking=True).unsqueeze(1)

            spec, phase = generator(mel)
            y_g_hat = stft.inverse(spec, phase)[..., : wav.size(-1)]
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), cfg["n_fft"], cfg["num_mels"], cfg["sampling_rate"],
                                          cfg["hop_size"], cfg["win_size"], cfg["fmin"], cfg["fmax_for_loss"])
            y_mel = mel_spectrogram(wav.squeeze(1), cfg["n_fft"], cfg["num_mels"], cfg["sampling_rate"],
                                    cfg["hop_size"], cfg["win_size"], cfg["fmin"], cfg["fmax_for_loss"])

            optim_d.zero_grad()
            r_f, g_f, _, _ = mpd(wav, y_g_hat.detach())
            r_s, g_s, _, _ = msd(wav, y_g_hat.detach())
            loss_d = discriminator_loss(r_f, g_f)[0] + discriminator_loss(r_s, g_s)[0]
            loss_d.backward()
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
            r_f, g_f, fm_rf, fm_gf = mpd(wav, y_g_hat)
            r_s, g_s, fm_rs, fm_gs = msd(wav, y_g_hat)
            loss_g = (generator_loss(g_f)[0] + generator_loss(g_s)[0] + feature_loss(fm_rf, fm_gf)
                      + feature_loss(fm_rs, fm_gs) + loss_mel)
            loss_g.backward()
            optim_g.step()

            if rank == 0:
                if steps % 100 == 0:
                    sw.add_scalar("train/loss_g", loss_g.item(), steps)
                    sw.add_scalar("train/loss_d", loss_d.item(), steps)
                    sw.add_scalar("train/mel_l1", loss_mel.item() / 45, steps)
                    print(f"step {steps} g {loss_g.item():.3f} d {loss_d.item():.3f} "
                          f"mel {loss_mel.item() / 45:.4f}", flush=True)
                if steps % 5000 == 0 and steps > 0:
                    torch.save({"generator": generator.module.state_dict()},
                               os.path.join(args.out, f"g_{steps:08d}"))
                    torch.save({"mpd": mpd.module.state_dict(), "msd": msd.module.state_dict(),
                                "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                                "steps": steps, "epoch": epoch},
                               os.path.join(args.out, f"do_{steps:08d}"))
            steps += 1
            if steps >= args.max_steps:
                break
        sched_g.step()
        sched_d.step()
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
