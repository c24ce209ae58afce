"""UnivNet-c32 training (LVC generator, MPD + MRD discriminators, multi-resolution STFT loss).

torchrun --nproc_per_node=4 19_univnet_train.py -c config/default_c32.yaml -n univnet_c32
"""
import argparse
import glob
import itertools
import logging
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from scipy.io.wavfile import read
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from model.discriminator import Discriminator
from model.generator import Generator
from utils.stft import TacotronSTFT
from utils.stft_loss import MultiResolutionSTFTLoss

MAX_WAV_VALUE = 32768.0
logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(message)s")
logger = logging.getLogger("univnet")


class MelFromDisk(Dataset):
    def __init__(self, hp, meta_file, train, device):
        self.hp, self.train, self.device = hp, train, device
        with open(meta_file, encoding="utf-8") as f:
            self.wav_list = [os.path.join(hp.data.base_dir, l.split("|")[0]) for l in f if l.strip()]
        self.mel_segment_length = hp.audio.segment_length // hp.audio.hop_length + 2
        self.stft = TacotronSTFT(hp.audio.filter_length, hp.audio.hop_length, hp.audio.win_length,
                                 hp.audio.n_mel_channels, hp.audio.sampling_rate,
                                 hp.audio.mel_fmin, hp.audio.mel_fmax, center=False).to(device)

    def __len__(self):
        return len(self.wav_list)

    @torch.no_grad()
    def get_mel(self, audio):
        mel = self.stft.mel_spectrogram(audio.unsqueeze(0).to(self.device))
        return mel.squeeze(0).cpu()

    def __getitem__(self, idx):
        sr, audio = read(self.wav_list[idx])
        audio = torch.from_numpy(audio / MAX_WAV_VALUE).float()
        if len(audio) < self.hp.audio.segment_length + self.hp.audio.pad_short:
            audio = F.pad(audio, (0, self.hp.audio.segment_length + self.hp.audio.pad_short - len(audio)),
                          mode="constant", value=0.0)
        mel = self.get_mel(audio)
        if self.train:
            max_mel_start = mel.size(1) - self.mel_segment_length - 1
            mel_start = random.randint(0, max_mel_start)
            mel_end = mel_start + self.mel_segment_length
            mel = mel[:, mel_start:mel_end]
            a_start = mel_start * self.hp.audio.hop_length
            audio = audio[a_start:a_start + self.hp.audio.segment_length]
        audio = audio + (1 / 32768) * torch.randn_like(audio)
        return mel, audio.unsqueeze(0)


def find_latest(chkpt_dir):
    cps = glob.glob(os.path.join(chkpt_dir, "*.pt"))
    return max(cps, key=os.path.getmtime) if cps else None


def validate(hp, generator, discriminator, valloader, stft, writer, step, device):
    generator.eval()
    discriminator.eval()
    loss_g_sum, mel_err_sum = 0.0, 0.0
    with torch.no_grad():
        for i, (mel, audio) in enumerate(valloader):
            mel, audio = mel.to(device), audio.to(device)
            noise = torch.randn(1, hp.gen.noise_dim, mel.size(2), device=device)
            fake_audio = generator(mel, noise)[:, :, :audio.size(2)]
            mel_fake = stft.mel_spectrogram(fake_audio.squeeze(1))
            mel_real = stft.mel_spectrogram(audio.squeeze(1))
            mel_err_sum += F.l1_loss(mel_fake, mel_real).item()
            for score_fake, _ in discriminator(fake_audio):
                loss_g_sum += torch.mean(torch.pow(score_fake - 1.0, 2)).item()
            if i < hp.log.num_audio:
                writer.add_audio(f"fake/{i}", fake_audio[0, 0].cpu(), step, hp.audio.sampling_rate)
                if step == 0:
                    writer.add_audio(f"real/{i}", audio[0, 0].cpu(), step, hp.audio.sampling_rate)
    writer.add_scalar("validation/mel_error", mel_err_sum / len(valloader), step)
    writer.add_scalar("validation/loss_g", loss_g_sum / len(valloader), step)
    generator.train()
    discriminator.train()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("-n", "--name", required=True)
    parser.add_argument("-p", "--checkpoint_path", default=None)
    args = parser.parse_args()
    hp = OmegaConf.load(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(hp.train.seed)

    chkpt_dir = os.path.join(hp.log.chkpt_dir, args.name)
    log_dir = os.path.join(hp.log.log_dir, args.name)
    writer = None
    if rank == 0:
        os.makedirs(chkpt_dir, exist_ok=True)
        os.makedirs(log_dir, exist_ok=True)
        writer = SummaryWriter(log_dir)

    model_g = Generator(hp).to(device)
    model_d = Discriminator(hp).to(device)
    optim_g = torch.optim.AdamW(model_g.parameters(), lr=hp.train.adam.lr,
                                betas=(hp.train.adam.beta1, hp.train.adam.beta2))
    optim_d = torch.optim.AdamW(model_d.parameters(), lr=hp.train.adam.lr,
                                betas=(hp.train.adam.beta1, hp.train.adam.beta2))
    stft_criterion = MultiResolutionSTFTLoss(device, eval(hp.mrd.resolutions))
    val_stft = TacotronSTFT(hp.audio.filter_length, hp.audio.hop_length, hp.audio.win_length,
                            hp.audio.n_mel_channels, hp.audio.sampling_rate, hp.audio.mel_fmin,
                            hp.audio.mel_fmax, center=False).to(device)

    step, epoch = 0, -1
    chkpt = args.checkpoint_path or find_latest(chkpt_dir)
    if chkpt is not None:
        cp = torch.load(chkpt, map_location="cpu")
        model_g.load_state_dict(cp["model_g"])
        model_d.load_state_dict(cp["model_d"])
        optim_g.load_state_dict(cp["optim_g"])
        optim_d.load_state_dict(cp["optim_d"])
        step, epoch = cp["step"], cp["epoch"]
        if rank == 0:
            logger.info(f"Resuming from {chkpt} at step {step}")

    model_g = DistributedDataParallel(model_g, device_ids=[local_rank])
    model_d = DistributedDataParallel(model_d, device_ids=[local_rank])

    trainset = MelFromDisk(hp, hp.data.train_file, True, device)
    train_sampler = DistributedSampler(trainset, shuffle=True)
    trainloader = DataLoader(trainset, batch_size=hp.train.batch_size, sampler=train_sampler,
                             num_workers=8, pin_memory=True, drop_last=True)
    if rank == 0:
        valset = MelFromDisk(hp, hp.data.val_file, False, device)
        valloader = DataLoader(valset, batch_size=1, shuffle=False, num_workers=0)

    model_g.train()
    model_d.train()
    while step < hp.train.max_steps:
        epoch += 1
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for mel, audio in trainloader:
            mel, audio = mel.to(device, non_blocking=True), audio.to(device, non_blocking=True)
            noise = torch.randn(hp.train.batch_size, hp.gen.noise_dim, mel.size(2), device=device)

            # generator
            optim_g.zero_grad()
            fake_audio = model_g(mel, noise)
            sc_loss, mag_loss = stft_criterion(fake_audio.squeeze(1), audio.squeeze(1))
            stft_loss = (sc_loss + mag_loss) * hp.train.stft_lamb
            res_fake = model_d(fake_audio)
            score_loss = sum(torch.mean(torch.pow(score_fake - 1.0, 2)) for score_fake, _ in res_fake) / len(res_fake)
            loss_g = score_loss + stft_loss
            loss_g.backward()
            optim_g.step()

            # discriminator
            optim_d.zero_grad()
            res_fake = model_d(fake_audio.detach())
            res_real = model_d(audio)
            loss_d = 0.0
            for (score_fake, _), (score_real, _) in zip(res_fake, res_real):
                loss_d = loss_d + torch.mean(torch.pow(score_real - 1.0, 2)) + torch.mean(torch.pow(score_fake, 2))
            loss_d = loss_d / len(res_fake)
            loss_d.backward()
            optim_d.step()
            step += 1

            if step % hp.log.summary_interval == 0:
                vals = torch.stack([loss_g.detach(), loss_d.detach(), stft_loss.detach(), score_loss.detach()])
                dist.all_reduce(vals)
                vals = (vals / world).tolist()
                if rank == 0:
                    for k, v in zip(("train/loss_g", "train/loss_d", "train/stft_loss", "train/score_loss"), vals):
                        writer.add_scalar(k, v, step)
                    logger.info(f"g {vals[0]:.04f} d {vals[1]:.04f} | step {step} | {time.time() - t0:.1f}s")

            if step % hp.log.validation_interval == 0:
                if rank == 0:
                    validate(hp, model_g.module, model_d.module, valloader, val_stft, writer, step, device)
                dist.barrier()

            if rank == 0 and step % hp.log.save_interval == 0:
                save_path = os.path.join(chkpt_dir, f"{args.name}_{step:07d}.pt")
                torch.save({"model_g": model_g.module.state_dict(), "model_d": model_d.module.state_dict(),
                            "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                            "step": step, "epoch": epoch, "hp_str": OmegaConf.to_yaml(hp)}, save_path)
                logger.info(f"Saved checkpoint to: {save_path}")
            if step >= hp.train.max_steps:
                break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
