"""HiFi-GAN V2 (small) on a multi-speaker 24 kHz corpus.

Validation runs on all ranks (each rank takes a slice of the full-length validation utterances);
the first few generated spectrograms of every rank are collected on rank 0 for TensorBoard.

    torchrun --nproc_per_node=8 17_hifigan_v2.py --config config_v2_24k.json --checkpoint_path cp_v2_24k
"""
import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from env import AttrDict
from meldataset import MelDataset, get_dataset_filelist, mel_spectrogram
from models import (Generator, MultiPeriodDiscriminator, MultiScaleDiscriminator, discriminator_loss,
                    feature_loss, generator_loss)
from utils import load_checkpoint, plot_spectrogram, scan_checkpoint

N_LOGGED = 2  # utterances per rank shown in TensorBoard


def build_loaders(a, h, device):
    train_files, val_files = get_dataset_filelist(a)
    trainset = MelDataset(train_files, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                          h.sampling_rate, h.fmin, h.fmax, n_cache_reuse=0, shuffle=False,
                          fmax_loss=h.fmax_for_loss, device=device)
    validset = MelDataset(val_files, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                          h.sampling_rate, h.fmin, h.fmax, False, False, n_cache_reuse=0,
                          fmax_loss=h.fmax_for_loss, device=device)
    train_sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(validset, shuffle=False, drop_last=True)
    train_loader = DataLoader(trainset, batch_size=h.batch_size, sampler=train_sampler,
                              num_workers=h.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(validset, batch_size=1, sampler=val_sampler, num_workers=1, pin_memory=True)
    return train_sampler, train_loader, val_loader


@torch.no_grad()
def validate(gen, val_loader, h, device, rank, world, sw, steps):
    gen.eval()
    err_sum = torch.zeros(2, device=device)
    for j, (x, y, _, y_mel) in enumerate(val_loader):
        y_g_hat = gen(x.to(device))
        y_mel = y_mel.to(device)
        y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate, h.hop_size,
                                      h.win_size, h.fmin, h.fmax_for_loss)
        n = min(y_mel.size(-1), y_g_hat_mel.size(-1))
        err_sum[0] += F.l1_loss(y_mel[..., :n], y_g_hat_mel[..., :n])
        err_sum[1] += 1

        if j < N_LOGGED:
            gathered = [torch.zeros_like(y_g_hat_mel) for _ in range(world)]
            dist.all_gather(gathered, y_g_hat_mel)
            if rank == 0:
                for r, m in enumerate(gathered):
                    sw.add_figure(f"generated/rank{r}_utt{j}", plot_spectrogram(m.squeeze(0).cpu().numpy()), steps)
                sw.add_audio(f"generated/rank0_utt{j}", y_g_hat[0].cpu(), steps, h.sampling_rate)
    dist.all_reduce(err_sum)
    gen.train()
    return (err_sum[0] / err_sum[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--input_wavs_dir", default="data/wavs24k")
    ap.add_argument("--input_training_file", default="filelists/train.txt")
    ap.add_argument("--input_validation_file", default="filelists/val.txt")
    ap.add_argument("--checkpoint_path", default="cp_hifigan_v2")
    ap.add_argument("--config", default="config_v2.json")
    ap.add_argument("--training_epochs", type=int, default=3100)
    ap.add_argument("--checkpoint_interval", type=int, default=5000)
    ap.add_argument("--summary_interval", type=int, default=100)
    ap.add_argument("--validation_interval", type=int, default=2000)
    a = ap.parse_args()
    with open(a.config) as f:
        h = AttrDict(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(h.seed)

    generator = Generator(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)

    steps, last_epoch, state_do = 0, -1, None
    if os.path.isdir(a.checkpoint_path):
        cp_g = scan_checkpoint(a.checkpoint_path, "g_")
        cp_do = scan_checkpoint(a.checkpoint_path, "do_")
        if cp_g and cp_do:
            generator.load_state_dict(load_checkpoint(cp_g, device)["generator"])
            state_do = load_checkpoint(cp_do, device)
            mpd.load_state_dict(state_do["mpd"])
            msd.load_state_dict(state_do["msd"])
            steps, last_epoch = state_do["steps"] + 1, state_do["epoch"]

    generator = DDP(generator, device_ids=[local_rank])
    mpd = DDP(mpd, device_ids=[local_rank])
    msd = DDP(msd, device_ids=[local_rank])
    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()), h.learning_rate,
                                betas=[h.adam_b1, h.adam_b2])
    if state_do is not None:
        optim_g.load_state_dict(state_do["optim_g"])
        optim_d.load_state_dict(state_do["optim_d"])
    scheduler_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    scheduler_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)

    train_sampler, train_loader, val_loader = build_loaders(a, h, device)
    sw = None
    if rank == 0:
        os.makedirs(a.checkpoint_path, exist_ok=True)
        sw = SummaryWriter(os.path.join(a.checkpoint_path, "logs"))

    generator.train()
    mpd.train()
    msd.train()
    for epoch in range(max(0, last_epoch), a.training_epochs):
        train_sampler.set_epoch(epoch)
        start = time.time()
        for x, y, _, y_mel in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).unsqueeze(1)
            y_mel = y_mel.to(device, non_blocking=True)

            y_g_hat = generator(x)
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate, h.hop_size,
                                          h.win_size, h.fmin, h.fmax_for_loss)

            optim_d.zero_grad()
            y_df_r, y_df_g, _, _ = mpd(y, y_g_hat.detach())
            y_ds_r, y_ds_g, _, _ = msd(y, y_g_hat.detach())
            loss_disc = discriminator_loss(y_df_r, y_df_g)[0] + discriminator_loss(y_ds_r, y_ds_g)[0]
            loss_disc.backward()
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
            y_df_r, y_df_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
            y_ds_r, y_ds_g, fmap_s_r, fmap_s_g = msd(y, y_g_hat)
            loss_gen_all = (generator_loss(y_df_g)[0] + generator_loss(y_ds_g)[0] + feature_loss(fmap_f_r, fmap_f_g)
                            + feature_loss(fmap_s_r, fmap_s_g) + loss_mel)
            loss_gen_all.backward()
            optim_g.step()

            if rank == 0:
                if steps % a.summary_interval == 0:
                    sw.add_scalar("training/gen_loss_total", loss_gen_all.item(), steps)
                    sw.add_scalar("training/disc_loss_total", loss_disc.item(), steps)
                    sw.add_scalar("training/mel_spec_error", loss_mel.item() / 45, steps)
                if steps % a.checkpoint_interval == 0 and steps != 0:
                    torch.save({"generator": generator.module.state_dict()},
                               f"{a.checkpoint_path}/g_{steps:08d}")
                    torch.save({"mpd": mpd.module.state_dict(), "msd": msd.module.state_dict(),
                                "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                                "steps": steps, "epoch": epoch}, f"{a.checkpoint_path}/do_{steps:08d}")

            if steps % a.validation_interval == 0:
                val_err = validate(generator.module, val_loader, h, device, rank, world, sw, steps)
                if rank == 0:
                    sw.add_scalar("validation/mel_spec_error", val_err, steps)
                    print(f"Steps {steps}: validation mel error {val_err:.4f}", flush=True)
            steps += 1

        scheduler_g.step()
        scheduler_d.step()
        if rank == 0:
            print(f"Epoch {epoch + 1} took {int(time.time() - start)} sec", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
