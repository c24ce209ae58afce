#!/usr/bin/env python
"""WaveGlow: flow-based vocoder (invertible 1x1 convs + WN affine coupling).

Multi-GPU: torchrun --nproc_per_node=8 14_waveglow_train.py -c config.json
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.io.wavfile import read
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from tacotron2.layers import TacotronSTFT

MAX_WAV_VALUE = 32768.0


class Mel2Samp(Dataset):
    def __init__(self, training_files, segment_length, filter_length, hop_length, win_length,
                 sampling_rate, mel_fmin, mel_fmax):
        with open(training_files) as f:
            self.audio_files = [l.strip() for l in f if l.strip()]
        random.seed(1234)
        random.shuffle(self.audio_files)
        self.stft = TacotronSTFT(filter_length=filter_length, hop_length=hop_length, win_length=win_length,
                                 sampling_rate=sampling_rate, mel_fmin=mel_fmin, mel_fmax=mel_fmax)
        self.segment_length = segment_length
        self.sampling_rate = sampling_rate

    def get_mel(self, audio):
        audio_norm = (audio / MAX_WAV_VALUE).unsqueeze(0)
        return self.stft.mel_spectrogram(audio_norm).squeeze(0)

    def __getitem__(self, index):
        sr, data = read(self.audio_files[index])
        if sr != self.sampling_rate:
            raise ValueError(f"{sr} SR doesn't match target {self.sampling_rate} SR")
        audio = torch.from_numpy(data).float()
        if audio.size(0) >= self.segment_length:
            start = random.randint(0, audio.size(0) - self.segment_length)
            audio = audio[start:start + self.segment_length]
        else:
            audio = F.pad(audio, (0, self.segment_length - audio.size(0)))
        return self.get_mel(audio), audio / MAX_WAV_VALUE

    def __len__(self):
        return len(self.audio_files)


class Invertible1x1Conv(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 1, bias=False)
        W = torch.linalg.qr(torch.randn(c, c))[0]
        if torch.det(W) < 0:
            W[:, 0] = -W[:, 0]
        self.conv.weight.data = W.view(c, c, 1)

    def forward(self, z, reverse=False):
        b, _, n = z.size()
        W = self.conv.weight.squeeze()
        if reverse:
            if not hasattr(self, "W_inverse"):
                self.W_inverse = W.float().inverse()[..., None].to(z.dtype)
            return F.conv1d(z, self.W_inverse)
        log_det_W = b * n * torch.logdet(W.float())
        return self.conv(z), log_det_W


class WN(nn.Module):
    def __init__(self, n_in, n_mel, n_layers, n_channels, kernel_size):
        super().__init__()
        self.n_layers, self.n_channels = n_layers, n_channels
        self.start = nn.utils.weight_norm(nn.Conv1d(n_in, n_channels, 1))
        self.end = nn.Conv1d(n_channels, 2 * n_in, 1)
        self.end.weight.data.zero_(); self.end.bias.data.zero_()
        self.cond_layer = nn.utils.weight_norm(nn.Conv1d(n_mel, 2 * n_channels * n_layers, 1))
        self.in_layers = nn.ModuleList()
        self.res_skip_layers = nn.ModuleList()
        for i in range(n_layers):
            d = 2 ** i
            self.in_layers.append(nn.utils.weight_norm(
                nn.Conv1d(n_channels, 2 * n_channels, kernel_size, dilation=d, padding=(kernel_size * d - d) // 2)))
            rs = 2 * n_channels if i < n_layers - 1 else n_channels
            self.res_skip_layers.append(nn.utils.weight_norm(nn.Conv1d(n_channels, rs, 1)))

    def forward(self, audio, spect):
        audio = self.start(audio)
        output = torch.zeros_like(audio)
        spect = self.cond_layer(spect)
        for i in range(self.n_layers):
            off = i * 2 * self.n_channels
            acts = self.in_layers[i](audio) + spect[:, off:off + 2 * self.n_channels]
            acts = torch.tanh(acts[:, :self.n_channels]) * torch.sigmoid(acts[:, self.n_channels:])
            rs = self.res_skip_layers[i](acts)
            if i < self.n_layers - 1:
                audio = audio + rs[:, :self.n_channels]
                output = output + rs[:, self.n_channels:]
            else:
                output = output + rs
        return self.end(output)


class WaveGlow(nn.Module):
    def __init__(self, n_mel_channels, n_flows, n_group, n_early_every, n_early_size, WN_config):
        super().__init__()
        self.upsample = nn.ConvTranspose1d(n_mel_channels, n_mel_channels, 1024, stride=256)
        self.n_flows, self.n_group = n_flows, n_group
        self.n_early_every, self.n_early_size = n_early_every, n_early_size
        self.WN = nn.ModuleList()
        self.convinv = nn.ModuleList()
        n_half, n_remaining = n_group // 2, n_group
        for k in range(n_flows):
            if k % n_early_every == 0 and k > 0:
                n_half -= n_early_size // 2
                n_remaining -= n_early_size
            self.convinv.append(Invertible1x1Conv(n_remaining))
            self.WN.append(WN(n_half, n_mel_channels * n_group, **WN_config))
        self.n_remaining_channels = n_remaining

    def forward(self, spect, audio):
        spect = self.upsample(spect)[:, :, :audio.size(1)]
        spect = spect.unfold(2, self.n_group, self.n_group).permute(0, 2, 1, 3)
        spect = spect.contiguous().view(spect.size(0), spect.size(1), -1).permute(0, 2, 1)
        audio = audio.unfold(1, self.n_group, self.n_group).permute(0, 2, 1)
        output_audio, log_s_list, log_det_W_list = [], [], []
        for k in range(self.n_flows):
            if k % self.n_early_every == 0 and k > 0:
                output_audio.append(audio[:, :self.n_early_size])
                audio = audio[:, self.n_early_size:]
            audio, log_det_W = self.convinv[k](audio)
            log_det_W_list.append(log_det_W)
            n_half = audio.size(1) // 2
            audio_0, audio_1 = audio[:, :n_half], audio[:, n_half:]
            out = self.WN[k](audio_0, spect)
            log_s, b = out[:, n_half:], out[:, :n_half]
            audio_1 = torch.exp(log_s) * audio_1 + b
            log_s_list.append(log_s)
            audio = torch.cat([audio_0, audio_1], 1)
        output_audio.append(audio)
        return torch.cat(output_audio, 1), log_s_list, log_det_W_list


class WaveGlowLoss(nn.Module):
    def __init__(self, sigma=1.0):
        super().__init__()
        self.sigma = sigma

    def forward(self, model_output):
        z, log_s_list, log_det_W_list = model_output
        log_s_total = sum(torch.sum(ls) for ls in log_s_list)
        log_det_W_total = sum(log_det_W_list)
        loss = torch.sum(z * z) / (2 * self.sigma * self.sigma) - log_s_total - log_det_W_total
        return loss / (z.size(0) * z.size(1) * z.size(2))


def train(args, train_config, data_config, waveglow_config):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend=train_config["dist_backend"], init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(train_config["seed"])
    torch.cuda.manual_seed(train_config["seed"])
    out_dir = train_config["output_directory"]

    criterion = WaveGlowLoss(train_config["sigma"])
    model = WaveGlow(**waveglow_config).cuda(args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=train_config["learning_rate"])
    scaler = torch.cuda.amp.GradScaler(enabled=train_config["fp16_run"])

    iteration = 0
    if train_config["checkpoint_path"]:
        ckpt = torch.load(train_config["checkpoint_path"], map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        iteration = ckpt["iteration"] + 1
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    trainset = Mel2Samp(**data_config)
    sampler = DistributedSampler(trainset, num_replicas=world, rank=rank)
    loader = DataLoader(trainset, num_workers=2, shuffle=False, sampler=sampler,
                        batch_size=train_config["batch_size"], pin_memory=False, drop_last=True)

    logger = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        logger = SummaryWriter(os.path.join(out_dir, "logs"))

    model.train()
    epoch_offset = max(0, int(iteration / len(loader)))
    for epoch in range(epoch_offset, train_config["epochs"]):
        sampler.set_epoch(epoch)
        for mel, audio in loader:
            mel = mel.cuda(args.local_rank, non_blocking=True)
            audio = audio.cuda(args.local_rank, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", enabled=train_config["fp16_run"]):
                outputs = model(mel, audio)
            loss = criterion(tuple(o.float() if torch.is_tensor(o) else [x.float() for x in o] for o in outputs))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.get("grad_clip_thresh", 100.0))
            scaler.step(optimizer)
            scaler.update()

            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            reduced = reduced.item() / world
            if rank == 0:
                print(f"{iteration}:\t{reduced:.9f}")
                logger.add_scalar("training_loss", reduced, iteration)
                if iteration % train_config["iters_per_checkpoint"] == 0:
                    path = os.path.join(out_dir, f"waveglow_{iteration}")
                    torch.save({"model": model.module.state_dict(), "iteration": iteration,
                                "optimizer": optimizer.state_dict(),
                                "learning_rate": train_config["learning_rate"]}, path)
            iteration += 1

    if logger is not None:
        logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", type=str, required=True, help="JSON file for configuration")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    with open(args.config) as f:
        config = json.loads(f.read())
    train_config = config["train_config"]
    data_config = config["data_config"]
    waveglow_config = config["waveglow_config"]

    torch.backends.cudnn.enabled = True
    torch.backends.cudnn.benchmark = False
    train(args, train_config, data_config, waveglow_config)
