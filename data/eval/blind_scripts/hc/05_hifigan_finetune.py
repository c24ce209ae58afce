"""Fine-tune a HiFi-GAN vocoder on ground-truth-aligned mels produced by the acoustic model.

    torchrun --nproc_per_node 8 05_hifigan_finetune.py --config configs/v1_ft.json \
        --pretrained pretrained/UNIVERSAL_V1 --output_dir exp/hifigan_ft_spk12
"""
import argparse
import glob
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from env import AttrDict
from meldataset import MelDataset, mel_spectrogram, get_dataset_filelist
from models import (Generator, MultiPeriodDiscriminator, MultiScaleDiscriminator,
                    feature_loss, generator_loss, discriminator_loss)


def latest(path, prefix):
    files = sorted(glob.glob(os.path.join(path, prefix + "????????")))
    return files[-1] if files else None


def load_checkpoint(path):
    print(f"Loading '{path}'")
    return torch.load(path)


def save_checkpoint(path, obj):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--pretrained", default=None, help="dir with g_xxxxxxxx / do_xxxxxxxx to start from")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--input_wavs_dir", default="data/wavs")
    ap.add_argument("--input_mels_dir", default="data/gta_mels")
    ap.add_argument("--input_training_file", default="data/train.txt")
    ap.add_argument("--input_validation_file", default="data/val.txt")
    ap.add_argument("--max_steps", type=int, default=200_000)
    a = ap.parse_args()

    with open(a.config) as f:
        h = AttrDict(json.load(f))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(h.seed)

    generator = Generator(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)

    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()), h.learning_rate,
                                betas=[h.adam_b1, h.adam_b2])

    steps, last_epoch = 0, -1
    cp_g, cp_do = latest(a.output_dir, "g_"), latest(a.output_dir, "do_")
    if cp_g is not None and cp_do is not None:
        # resume our own run
        state_g, state_do = load_checkpoint(cp_g), load_checkpoint(cp_do)
        generator.load_state_dict(state_g["generator"])
        mpd.load_state_dict(state_do["mpd"])
        msd.load_state_dict(state_do["msd"])
        optim_g.load_state_dict(state_do["optim_g"])
        optim_d.load_state_dict(state_do["optim_d"])
        steps, last_epoch = state_do["steps"] + 1, state_do["epoch"]
        del state_g, state_do
    elif a.pretrained is not None:
        # start from the released vocoder, fresh optimizers
        state_g = load_checkpoint(latest(a.pretrained, "g_"))
        state_do = load_checkpoint(latest(a.pretrained, "do_"))
        generator.load_state_dict(state_g["generator"])
        mpd.load_state_dict(state_do["mpd"])
        msd.load_state_dict(state_do["msd"])
        del state_g, state_do

    generator = DDP(generator, device_ids=[local_rank])
    mpd = DDP(mpd, device_ids=[local_rank])
    msd = DDP(msd, device_ids=[local_rank])

    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)

    train_files, val_files = get_dataset_filelist(a)
    trainset = MelDataset(train_files, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                          h.sampling_rate, h.fmin, h.fmax, n_cache_reuse=0, shuffle=False,
                          fmax_loss=h.fmax_for_loss, device=None, fine_tuning=True,
                          base_mels_path=a.input_mels_dir)
    sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    loader = DataLoader(trainset, batch_size=h.batch_size // world, sampler=sampler, num_workers=h.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    sw = None
    if rank == 0:
        os.makedirs(a.output_dir, exist_ok=True)
        sw = SummaryWriter(os.path.join(a.output_dir, "logs"))
        validset = MelDataset(val_files, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                              h.sampling_rate, h.fmin, h.fmax, False, False, n_cache_reuse=0,
                              fmax_loss=h.fmax_for_loss, device=None, fine_tuning=True,
                              base_mels_path=a.input_mels_dir)
        val_loader = DataLoader(validset, batch_size=1, shuffle=False, num_workers=1)

    epoch = max(0, last_epoch)
    done = False
    while not done:
        sampler.set_epoch(epoch)
        generator.train(); mpd.train(); msd.train()
        t_epoch = time.time()
        for x, y, _, y_mel in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).unsqueeze(1)
            y_mel = y_mel.to(device, non_blocking=True)

            y_g_hat = generator(x)
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate, h.hop_size,
                                          h.win_size, h.fmin, h.fmax_for_loss)

            optim_d.zero_grad()
            y_df_r, y_df_g, _, _ = mpd(y, y_g_hat.detach())
            loss_disc_f, _, _ = discriminator_loss(y_df_r, y_df_g)
            y_ds_r, y_ds_g, _, _ = msd(y, y_g_hat.detach())
            loss_disc_s, _, _ = discriminator_loss(y_ds_r, y_ds_g)
            loss_disc = loss_disc_f + loss_disc_s
            loss_disc.backward()
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
            y_df_r, y_df_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
            y_ds_r, y_ds_g, fmap_s_r, fmap_s_g = msd(y, y_g_hat)
            loss_fm = feature_loss(fmap_f_r, fmap_f_g) + feature_loss(fmap_s_r, fmap_s_g)
            loss_gen_f, _ = generator_loss(y_df_g)
            loss_gen_s, _ = generator_loss(y_ds_g)
            loss_gen = loss_gen_f + loss_gen_s + loss_fm + loss_mel
            loss_gen.backward()
            optim_g.step()

            if rank == 0:
                if steps % h.stdout_interval == 0:
                    print(f"step {steps}  g {loss_gen.item():.3f}  d {loss_disc.item():.3f}  "
                          f"mel {loss_mel.item() / 45:.4f}")
                    sw.add_scalar("training/gen_loss_total", loss_gen.item(), steps)
                    sw.add_scalar("training/disc_loss_total", loss_disc.item(), steps)
                    sw.add_scalar("training/mel_spec_error", loss_mel.item() / 45, steps)

                if steps % h.checkpoint_interval == 0 and steps != 0:
                    save_checkpoint(os.path.join(a.output_dir, f"g_{steps:08d}"),
                                    {"generator": generator.module.state_dict()})
                    save_checkpoint(os.path.join(a.output_dir, f"do_{steps:08d}"),
                                    {"mpd": mpd.module.state_dict(), "msd": msd.module.state_dict(),
                                     "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                                     "steps": steps, "epoch": epoch})

                if steps % h.validation_interval == 0:
                    g = generator.module
                    g.eval()
                    err, n = 0.0, 0
                    with torch.no_grad():
                        for j, (vx, vy, _, vmel) in enumerate(val_loader):
                            vy_hat = g(vx.to(device))
                            vy_hat_mel = mel_spectrogram(vy_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate,
                                                         h.hop_size, h.win_size, h.fmin, h.fmax_for_loss)
                            T = min(vy_hat_mel.size(-1), vmel.size(-1))
                            err += F.l1_loss(vmel.to(device)[..., :T], vy_hat_mel[..., :T]).item()
                            n += 1
                            if j < 4:
                                sw.add_audio(f"generated/y_hat_{j}", vy_hat[0], steps, h.sampling_rate)
                    sw.add_scalar("validation/mel_spec_error", err / max(n, 1), steps)
                    g.train()

            steps += 1
            if steps >= a.max_steps:
                done = True
                break

        sched_g.step()
        sched_d.step()
        if rank == 0:
            print(f"epoch {epoch + 1} took {time.time() - t_epoch:.0f}s")
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
