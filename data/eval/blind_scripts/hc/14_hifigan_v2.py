"""HiFi-GAN V2 for an in-house 48 kHz TTS voice.

Generator-only warm-up with the mel loss for `disc_start_step` steps, then the full GAN objective
(MPD + MSD). One process per GPU via torch.multiprocessing.

    python 14_hifigan_v2.py --config configs/v2_48k.json --checkpoint_path cp/v2_48k
"""
import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter

from env import AttrDict
from meldataset import MelDataset, get_dataset_filelist, mel_spectrogram
from models import (Generator, MultiPeriodDiscriminator, MultiScaleDiscriminator, discriminator_loss,
                    feature_loss, generator_loss)
from utils import scan_checkpoint, plot_spectrogram


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def train(rank, world_size, a, h):
    setup(rank, world_size, a.port)
    device = torch.device("cuda", rank)
    torch.manual_seed(h.seed)

    generator = Generator(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)

    steps, last_epoch, best = 0, -1, float("inf")
    cp_g, cp_do = scan_checkpoint(a.checkpoint_path, "g_"), scan_checkpoint(a.checkpoint_path, "do_")
    state_do = None
    if cp_g is not None and cp_do is not None:
        loc = {"cuda:0": f"cuda:{rank}"}
        generator.load_state_dict(torch.load(cp_g, map_location=loc)["generator"])
        state_do = torch.load(cp_do, map_location=loc)
        mpd.load_state_dict(state_do["mpd"])
        msd.load_state_dict(state_do["msd"])
        steps, last_epoch, best = state_do["steps"] + 1, state_do["epoch"], state_do.get("best", best)

    generator = DDP(generator, device_ids=[rank])
    # spectral-norm power-iteration vectors are per-replica state, no need to broadcast them every forward
    mpd = DDP(mpd, device_ids=[rank], broadcast_buffers=False)
    msd = DDP(msd, device_ids=[rank], broadcast_buffers=False)

    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()), h.learning_rate,
                                betas=[h.adam_b1, h.adam_b2])
    if state_do is not None:
        optim_g.load_state_dict(state_do["optim_g"])
        optim_d.load_state_dict(state_do["optim_d"])
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)

    train_files, val_files = get_dataset_filelist(a)
    trainset = MelDataset(train_files, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                          h.sampling_rate, h.fmin, h.fmax, n_cache_reuse=0, shuffle=False,
                          fmax_loss=h.fmax_for_loss, device=None)
    validset = MelDataset(val_files, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                          h.sampling_rate, h.fmin, h.fmax, False, False, n_cache_reuse=0,
                          fmax_loss=h.fmax_for_loss, device=None)
    sampler = DistributedSampler(trainset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(trainset, batch_size=h.batch_size, sampler=sampler, num_workers=h.num_workers,
                        pin_memory=True, drop_last=True)
    # every rank scores a disjoint slice of the validation set (no padding duplicates)
    val_loader = DataLoader(Subset(validset, range(rank, len(validset), world_size)), batch_size=1,
                            num_workers=1)

    sw = SummaryWriter(os.path.join(a.checkpoint_path, "logs")) if rank == 0 else None
    stop = torch.zeros(1, device=device)
    bad_evals = 0

    for epoch in range(max(0, last_epoch), a.training_epochs):
        sampler.set_epoch(epoch)
        generator.train(); mpd.train(); msd.train()
        t0 = time.time()
        for x, y, _, y_mel in loader:
            x, y, y_mel = x.to(device, non_blocking=True), y.to(device, non_blocking=True), y_mel.to(device)
            y = y.unsqueeze(1)
            y_g_hat = generator(x)
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate, h.hop_size,
                                          h.win_size, h.fmin, h.fmax_for_loss)
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45

            if steps >= h.disc_start_step:
                optim_d.zero_grad()
                y_df_r, y_df_g, _, _ = mpd(y, y_g_hat.detach())
                y_ds_r, y_ds_g, _, _ = msd(y, y_g_hat.detach())
                loss_d = discriminator_loss(y_df_r, y_df_g)[0] + discriminator_loss(y_ds_r, y_ds_g)[0]
                loss_d.backward()
                optim_d.step()

                _, y_df_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
                _, y_ds_g, fmap_s_r, fmap_s_g = msd(y, y_g_hat)
                loss_adv = generator_loss(y_df_g)[0] + generator_loss(y_ds_g)[0]
                loss_fm = feature_loss(fmap_f_r, fmap_f_g) + feature_loss(fmap_s_r, fmap_s_g)
                loss_g = loss_mel + loss_adv + loss_fm
            else:
                loss_d = torch.zeros((), device=device)
                loss_g = loss_mel

            optim_g.zero_grad()
            loss_g.backward()
            optim_g.step()

            if steps % h.stdout_interval == 0:
                logged = torch.stack([loss_g.detach(), loss_d.detach(), loss_mel.detach() / 45])
                dist.all_reduce(logged)
                logged /= world_size
                if rank == 0:
                    print(f"step {steps} g {logged[0]:.3f} d {logged[1]:.3f} mel {logged[2]:.4f}")
                    sw.add_scalar("training/gen_loss_total", logged[0].item(), steps)
                    sw.add_scalar("training/disc_loss_total", logged[1].item(), steps)
                    sw.add_scalar("training/mel_spec_error", logged[2].item(), steps)

            if steps % h.validation_interval == 0 and steps > 0:
                g = generator.module
                g.eval()
                acc = torch.zeros(2, device=device)
                with torch.no_grad():
                    for j, (vx, vy, _, vmel) in enumerate(val_loader):
                        vy_hat = g(vx.to(device))
                        vmel_hat = mel_spectrogram(vy_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate,
                                                   h.hop_size, h.win_size, h.fmin, h.fmax_for_loss)
                        acc[0] += F.l1_loss(vmel.to(device), vmel_hat)
                        acc[1] += 1
                        if rank == 0 and j < 3:
                            sw.add_audio(f"generated/y_hat_{j}", vy_hat[0], steps, h.sampling_rate)
                            sw.add_figure(f"generated/y_hat_spec_{j}",
                                          plot_spectrogram(vmel_hat.squeeze(0).cpu().numpy()), steps)
                dist.all_reduce(acc)
                val_err = (acc[0] / acc[1]).item()
                g.train()

                if rank == 0:
                    sw.add_scalar("validation/mel_spec_error", val_err, steps)
                    if val_err < best:
                        best, bad_evals = val_err, 0
                    else:
                        bad_evals += 1
                    torch.save({"generator": g.state_dict()}, f"{a.checkpoint_path}/g_{steps:08d}")
                    torch.save({"mpd": mpd.module.state_dict(), "msd": msd.module.state_dict(),
                                "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                                "steps": steps, "epoch": epoch, "best": best},
                               f"{a.checkpoint_path}/do_{steps:08d}")
                    stop.fill_(1.0 if bad_evals >= a.patience else 0.0)
                dist.broadcast(stop, src=0)
                if stop.item() > 0:
                    break
            steps += 1

        sched_g.step()
        sched_d.step()
        if rank == 0:
            print(f"epoch {epoch + 1}: {time.time() - t0:.0f}s")
        if stop.item() > 0:
            if rank == 0:
                print(f"no improvement for {a.patience} validations, stopping at step {steps}")
            break

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--checkpoint_path", default="cp_hifigan_v2")
    ap.add_argument("--input_wavs_dir", default="data/wavs48k")
    ap.add_argument("--input_training_file", default="filelists/train.txt")
    ap.add_argument("--input_validation_file", default="filelists/val.txt")
    ap.add_argument("--training_epochs", type=int, default=3000)
    ap.add_argument("--patience", type=int, default=20)
    ap.add_argument("--port", type=int, default=29533)
    a = ap.parse_args()

    with open(a.config) as f:
        h = AttrDict(json.load(f))
    os.makedirs(a.checkpoint_path, exist_ok=True)
    with open(os.path.join(a.checkpoint_path, "config.json"), "w") as f:
        json.dump(h, f, indent=2)

    world_size = torch.cuda.device_count()
    h.batch_size = h.batch_size // world_size
    mp.spawn(train, args=(world_size, a, h), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
