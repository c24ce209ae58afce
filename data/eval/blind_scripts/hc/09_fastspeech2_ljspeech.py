"""FastSpeech2 on LJSpeech: feature extraction (mel / pitch / energy) + DDP training in one entry point.

torchrun --nproc_per_node=4 09_fastspeech2_ljspeech.py --raw_dir LJSpeech-1.1 --out_dir preprocessed/LJSpeech \
    --align_dir TextGrid/LJSpeech --exp exp/fs2_ljs
"""
import argparse
import glob
import json
import os

import librosa
import numpy as np
import pyworld as pw
import tgt
import torch
import yaml
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from model import FastSpeech2, FastSpeech2Loss, ScheduledOptim
from dataset import Dataset
from utils.tools import to_device

SR, N_FFT, HOP, WIN, N_MELS = 22050, 1024, 256, 1024, 80
MEL_BASIS = librosa.filters.mel(sr=SR, n_fft=N_FFT, n_mels=N_MELS, fmin=0, fmax=8000)


def get_alignment(tier):
    phones, durations, start_time, end_time, end_idx = [], [], 0.0, 0.0, 0
    for t in tier._objects:
        s, e, p = t.start_time, t.end_time, t.text
        if not phones and p in ("sil", "sp", "spn"):
            continue
        if not phones:
            start_time = s
        phones.append(p)
        if p not in ("sil", "sp", "spn"):
            end_time, end_idx = e, len(phones)
        durations.append(int(np.round(e * SR / HOP) - np.round(s * SR / HOP)))
    return phones[:end_idx], durations[:end_idx], start_time, end_time


def extract_one(wav_path, tg_path):
    textgrid = tgt.io.read_textgrid(tg_path)
    phones, durations, start, end = get_alignment(textgrid.get_tier_by_name("phones"))
    wav, _ = librosa.load(wav_path, sr=SR)
    wav = wav[int(SR * start):int(SR * end)].astype(np.float64)

    pitch, t = pw.dio(wav, SR, frame_period=HOP / SR * 1000)
    pitch = pw.stonemask(wav, pitch, t, SR)[: sum(durations)]
    stft = np.abs(librosa.stft(wav.astype(np.float32), n_fft=N_FFT, hop_length=HOP, win_length=WIN))
    mel = np.log(np.clip(MEL_BASIS @ stft, 1e-5, None))[:, : sum(durations)]
    energy = np.linalg.norm(stft, axis=0)[: sum(durations)]

    # phoneme-level averaging
    pos, p_avg, e_avg = 0, [], []
    for d in durations:
        seg_p = pitch[pos:pos + d]
        seg_p = seg_p[seg_p > 0]
        p_avg.append(seg_p.mean() if len(seg_p) else 0.0)
        e_avg.append(energy[pos:pos + d].mean() if d > 0 else 0.0)
        pos += d
    return " ".join(phones), np.array(durations), np.array(p_avg), np.array(e_avg), mel.T


def prepare_features(raw_dir, align_dir, out_dir, val_size=512):
    if os.path.exists(os.path.join(out_dir, "stats.json")):
        return
    for sub in ("mel", "pitch", "energy", "duration"):
        os.makedirs(os.path.join(out_dir, sub), exist_ok=True)

    lines, pitch_vals, energy_vals = [], [], []
    for wav_path in tqdm(sorted(glob.glob(os.path.join(raw_dir, "wavs", "*.wav")))):
        base = os.path.basename(wav_path)[:-4]
        tg_path = os.path.join(align_dir, base + ".TextGrid")
        if not os.path.exists(tg_path):
            continue
        phones, dur, pitch, energy, mel = extract_one(wav_path, tg_path)
        np.save(os.path.join(out_dir, "duration", f"LJSpeech-duration-{base}.npy"), dur)
        np.save(os.path.join(out_dir, "pitch", f"LJSpeech-pitch-{base}.npy"), pitch)
        np.save(os.path.join(out_dir, "energy", f"LJSpeech-energy-{base}.npy"), energy)
        np.save(os.path.join(out_dir, "mel", f"LJSpeech-mel-{base}.npy"), mel)
        pitch_vals.append(pitch[pitch > 0])
        energy_vals.append(energy)
        lines.append(f"{base}|LJSpeech|{{{phones}}}|")

    p_all, e_all = np.concatenate(pitch_vals), np.concatenate(energy_vals)
    p_mean, p_std, e_mean, e_std = float(p_all.mean()), float(p_all.std()), float(e_all.mean()), float(e_all.std())

    # normalise in place, keep min / max of the normalised values for the bin edges
    stats = {}
    for name, mean, std in (("pitch", p_mean, p_std), ("energy", e_mean, e_std)):
        lo, hi = np.finfo(np.float64).max, np.finfo(np.float64).min
        for f in glob.glob(os.path.join(out_dir, name, "*.npy")):
            v = (np.load(f) - mean) / std
            np.save(f, v)
            lo, hi = min(lo, v.min()), max(hi, v.max())
        stats[name] = [float(lo), float(hi), mean, std]

    rng = np.random.default_rng(0)
    rng.shuffle(lines)
    with open(os.path.join(out_dir, "val.txt"), "w") as f:
        f.write("\n".join(lines[:val_size]) + "\n")
    with open(os.path.join(out_dir, "train.txt"), "w") as f:
        f.write("\n".join(lines[val_size:]) + "\n")
    with open(os.path.join(out_dir, "speakers.json"), "w") as f:
        json.dump({"LJSpeech": 0}, f)
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump(stats, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw_dir", required=True)
    ap.add_argument("--align_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--config_dir", default="config/LJSpeech")
    ap.add_argument("--total_step", type=int, default=900_000)
    ap.add_argument("--batch_size", type=int, default=16)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    prepare_features(args.raw_dir, args.align_dir, args.out_dir)

    preprocess_config = yaml.safe_load(open(os.path.join(args.config_dir, "preprocess.yaml")))
    model_config = yaml.safe_load(open(os.path.join(args.config_dir, "model.yaml")))
    train_config = yaml.safe_load(open(os.path.join(args.config_dir, "train.yaml")))
    preprocess_config["path"]["preprocessed_path"] = args.out_dir
    train_config["optimizer"]["batch_size"] = args.batch_size

    train_set = Dataset("train.txt", preprocess_config, train_config, sort=True, drop_last=True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    group = 4
    loader = DataLoader(train_set, batch_size=args.batch_size * group, sampler=sampler,
                        collate_fn=train_set.collate_fn, num_workers=4, pin_memory=True, drop_last=True)

    model = FastSpeech2(preprocess_config, model_config).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = ScheduledOptim(model, train_config, model_config, 0)
    loss_fn = FastSpeech2Loss(preprocess_config, model_config).to(device)
    grad_clip = train_config["optimizer"]["grad_clip_thresh"]
    grad_acc = train_config["optimizer"]["grad_acc_step"]

    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.exp, "ckpt"), exist_ok=True)
        writer = SummaryWriter(os.path.join(args.exp, "log"))

    step, epoch = 1, 1
    while step <= args.total_step:
        sampler.set_epoch(epoch)
        for batchs in loader:
            for batch in batchs:
                batch = to_device(batch, device)
                output = model(*(batch[2:]))
                losses = loss_fn(batch, output)
                total_loss = losses[0] / grad_acc
                total_loss.backward()
                if step % grad_acc == 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                    optimizer.step_and_update_lr()
                    optimizer.zero_grad()

                if rank == 0 and step % 100 == 0:
                    names = ["total", "mel", "postnet_mel", "pitch", "energy", "duration"]
                    for n, l in zip(names, losses):
                        writer.add_scalar(f"loss/{n}", l.item(), step)
                if rank == 0 and step % 10000 == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer._optimizer.state_dict()},
                               os.path.join(args.exp, "ckpt", f"{step}.pth.tar"))
                step += 1
                if step > args.total_step:
                    break
            if step > args.total_step:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
