"""Fine-tune a pretrained HiFi-GAN on ground-truth-aligned mels from an acoustic model (VCTK).

Launched with torchrun; one process per GPU.
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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from env import AttrDict
from meldataset import MelDataset, mel_spectrogram, get_dataset_filelist
from models import (Generator, MultiPeriodDiscriminator, MultiScaleDiscriminator,
                    feature_loss, generator_loss, discriminator_loss)
from utils import plot_spectrogram

torch.backends.cudnn.benchmark = True


def scan_checkpoint(cp_dir, prefix):
    cp_list = sorted(glob.glob(os.path.join(cp_dir, prefix + "????????")))
    return cp_list[-1] if cp_list else None


def load_checkpoint(filepath):
    assert os.path.isfile(filepath)
    print("Loading '{}'".format(filepath))
    checkpoint_dict = torch.load(filepath)
    return checkpoint_dict


def save_checkpoint(filepath, obj):
    tmp = filepath + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, filepath)
    print("Saved '{}'".format(filepath))


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def train(a, h):
    rank, world_size, local_rank = setup_distributed()
    torch.manual_seed(h.seed)
    device = torch.device("cuda", local_rank)

    generator = Generator(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)

    if rank == 0:
        os.makedirs(a.checkpoint_path, exist_ok=True)
        print("checkpoints directory : ", a.checkpoint_path)
    dist.barrier()

    cp_g = scan_checkpoint(a.checkpoint_path, "g_")
    cp_do = scan_checkpoint(a.checkpoint_path, "do_")
    if cp_g is None and a.pretrained_dir:
        # start from the public universal checkpoint
        cp_g = os.path.join(a.pretrained_dir, "g_02500000")
        cp_do = os.path.join(a.pretrained_dir, "do_02500000")
        reset_steps = True
    else:
        reset_steps = False

    steps = 0
    last_epoch = -1
    state_dict_do = None
    if cp_g is not None:
        state_dict_g = load_checkpoint(cp_g)
        state_dict_do = load_checkpoint(cp_do)
        generator.load_state_dict(state_dict_g["generator"])
        mpd.load_state_dict(state_dict_do["mpd"])
        msd.load_state_dict(state_dict_do["msd"])
        if not reset_steps:
            steps = state_dict_do["steps"] + 1
            last_epoch = state_dict_do["epoch"]

    generator = DistributedDataParallel(generator, device_ids=[local_rank])
    mpd = DistributedDataParallel(mpd, device_ids=[local_rank])
    msd = DistributedDataParallel(msd, device_ids=[local_rank])

    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()),
                                h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    if state_dict_do is not None and not reset_steps:
        optim_g.load_state_dict(state_dict_do["optim_g"])
        optim_d.load_state_dict(state_dict_do["optim_d"])

    scheduler_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    scheduler_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)

    training_filelist, validation_filelist = get_dataset_filelist(a)
    trainset = MelDataset(training_filelist, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                          h.sampling_rate, h.fmin, h.fmax, n_cache_reuse=0, shuffle=False,
                          fmax_loss=h.fmax_for_loss, device=device, fine_tuning=True,
                          base_mels_path=a.input_mels_dir)
    train_sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    train_loader = DataLoader(trainset, num_workers=h.num_workers, shuffle=False, sampler=train_sampler,
                              batch_size=h.batch_size, pin_memory=True, drop_last=True)

    sw = None
    validation_loader = None
    if rank == 0:
        validset = MelDataset(validation_filelist, h.segment_size, h.n_fft, h.num_mels, h.hop_size,
                              h.win_size, h.sampling_rate, h.fmin, h.fmax, False, False, n_cache_reuse=0,
                              fmax_loss=h.fmax_for_loss, device=device, fine_tuning=True,
                              base_mels_path=a.input_mels_dir)
        validation_loader = DataLoader(validset, num_workers=1, shuffle=False, sampler=None,
                                       batch_size=1, pin_memory=True, drop_last=True)
        sw = SummaryWriter(os.path.join(a.checkpoint_path, "logs"))

    generator.train()
    mpd.train()
    msd.train()
    for epoch in range(max(0, last_epoch), a.training_epochs):
        start = time.time()
        train_sampler.set_epoch(epoch)
        if rank == 0:
            print("Epoch: {}".format(epoch + 1))

        for i, batch in enumerate(train_loader):
            start_b = time.time()
            x, y, _, y_mel = batch
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).unsqueeze(1)
            y_mel = y_mel.to(device, non_blocking=True)

            y_g_hat = generator(x)
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate,
                                          h.hop_size, h.win_size, h.fmin, h.fmax_for_loss)
            # fine-tuning mels are teacher-forced, lengths can be off by a frame
            min_len = min(y_mel.size(-1), y_g_hat_mel.size(-1))
            y_mel, y_g_hat_mel = y_mel[..., :min_len], y_g_hat_mel[..., :min_len]

            optim_d.zero_grad()
            y_df_hat_r, y_df_hat_g, _, _ = mpd(y, y_g_hat.detach())
            loss_disc_f, _, _ = discriminator_loss(y_df_hat_r, y_df_hat_g)
            y_ds_hat_r, y_ds_hat_g, _, _ = msd(y, y_g_hat.detach())
            loss_disc_s, _, _ = discriminator_loss(y_ds_hat_r, y_ds_hat_g)
            loss_disc_all = loss_disc_s + loss_disc_f
            loss_disc_all.backward()
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
            y_df_hat_r, y_df_hat_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
            y_ds_hat_r, y_ds_hat_g, fmap_s_r, fmap_s_g = msd(y, y_g_hat)
            loss_fm_f = feature_loss(fmap_f_r, fmap_f_g)
            loss_fm_s = feature_loss(fmap_s_r, fmap_s_g)
            loss_gen_f, _ = generator_loss(y_df_hat_g)
            loss_gen_s, _ = generator_loss(y_ds_hat_g)
            loss_gen_all = loss_gen_s + loss_gen_f + loss_fm_s + loss_fm_f + loss_mel
            loss_gen_all.backward()
            optim_g.step()

            if rank == 0:
                if steps % a.stdout_interval == 0:
                    print("Steps : {:d}, Gen Loss Total : {:4.3f}, Mel-Spec. Error : {:4.3f}, s/b : {:4.3f}".format(
                        steps, loss_gen_all.item(), loss_mel.item() / 45, time.time() - start_b))

                if steps % a.checkpoint_interval == 0 and steps != 0:
                    save_checkpoint("{}/g_{:08d}".format(a.checkpoint_path, steps),
                                    {"generator": generator.module.state_dict()})
                    save_checkpoint("{}/do_{:08d}".format(a.checkpoint_path, steps),
                                    {"mpd": mpd.module.state_dict(), "msd": msd.module.state_dict(),
                                     "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                                     "steps": steps, "epoch": epoch})

                if steps % a.summary_interval == 0:
                    sw.add_scalar("training/gen_loss_total", loss_gen_all.item(), steps)
                    sw.add_scalar("training/mel_spec_error", loss_mel.item() / 45, steps)

                if steps % a.validation_interval == 0:
                    validate(generator.module, validation_loader, sw, h, device, steps)

            steps += 1

        scheduler_g.step()
        scheduler_d.step()
        if rank == 0:
            print("Time taken for epoch {} is {} sec\n".format(epoch + 1, int(time.time() - start)))

    dist.destroy_process_group()


@torch.no_grad()
def validate(gen, loader, sw, h, device, steps):
    gen.eval()
    torch.cuda.empty_cache()
    val_err_tot = 0.0
    for j, batch in enumerate(loader):
        x, y, _, y_mel = batch
        y_g_hat = gen(x.to(device))
        y_mel = y_mel.to(device)
        y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate,
                                      h.hop_size, h.win_size, h.fmin, h.fmax_for_loss)
        min_len = min(y_mel.size(-1), y_g_hat_mel.size(-1))
        val_err_tot += F.l1_loss(y_mel[..., :min_len], y_g_hat_mel[..., :min_len]).item()
        if j <= 4:
            if steps == 0:
                sw.add_audio("gt/y_{}".format(j), y[0], steps, h.sampling_rate)
            sw.add_audio("generated/y_hat_{}".format(j), y_g_hat[0], steps, h.sampling_rate)
            sw.add_figure("generated/y_hat_spec_{}".format(j),
                          plot_spectrogram(y_g_hat_mel[0].cpu().numpy()), steps)
    sw.add_scalar("validation/mel_spec_error", val_err_tot / (j + 1), steps)
    gen.train()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input_wavs_dir", default="VCTK-Corpus/wav22")
    parser.add_argument("--input_mels_dir", default="ft_dataset")
    parser.add_argument("--input_training_file", default="VCTK-Corpus/training.txt")
    parser.add_argument("--input_validation_file", default="VCTK-Corpus/validation.txt")
    parser.add_argument("--checkpoint_path", default="cp_hifigan_vctk_ft")
    parser.add_argument("--pretrained_dir", default="pretrained/UNIVERSAL_V1")
    parser.add_argument("--config", default="config_v1.json")
    parser.add_argument("--training_epochs", default=3100, type=int)
    parser.add_argument("--stdout_interval", default=5, type=int)
    parser.add_argument("--checkpoint_interval", default=5000, type=int)
    parser.add_argument("--summary_interval", default=100, type=int)
    parser.add_argument("--validation_interval", default=1000, type=int)
    a = parser.parse_args()

    with open(a.config) as f:
        h = AttrDict(json.load(f))
    train(a, h)


if __name__ == "__main__":
    main()
