"""BigVGAN-base (anti-aliased periodic activations) with MPD + multi-resolution discriminator.

    torchrun --nproc_per_node=8 19_bigvgan_train.py --config configs/bigvgan_base_24khz_100band.json \
        --checkpoint_path exp/bigvgan_base
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
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from bigvgan import BigVGAN
from discriminators import MultiPeriodDiscriminator, MultiResolutionDiscriminator
from loss import discriminator_loss, feature_loss, generator_loss, MultiScaleMelSpectrogramLoss
from meldataset import MelDataset, get_dataset_filelist, mel_spectrogram
from env import AttrDict
from utils import plot_spectrogram, scan_checkpoint, save_checkpoint


def reduce_tensor(t):
    rt = t.detach().clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / dist.get_world_size()


@torch.no_grad()
def validate(generator, loader, h, device, sw, steps):
    generator.eval()
    val_err_tot = torch.zeros((), device=device)
    n = 0
    for j, (x, y, _, y_mel) in enumerate(loader):
        y_g_hat = generator(x.to(device))
        y_mel = y_mel.to(device)
        y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate, h.hop_size,
                                      h.win_size, h.fmin, h.fmax_for_loss)
        T = min(y_mel.size(-1), y_g_hat_mel.size(-1))
        val_err_tot += F.l1_loss(y_mel[..., :T], y_g_hat_mel[..., :T])
        n += 1
        if j < 4:
            sw.add_audio(f"generated/y_hat_{j}", y_g_hat[0], steps, h.sampling_rate)
            sw.add_figure(f"generated/y_hat_spec_{j}", plot_spectrogram(y_g_hat_mel[0].cpu().numpy()), steps)
            if steps == 0:
                sw.add_audio(f"gt/y_{j}", y[0], steps, h.sampling_rate)
    val_err = reduce_tensor(val_err_tot / max(n, 1)).item()
    sw.add_scalar("validation/mel_spec_error", val_err, steps)
    generator.train()
    return val_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--checkpoint_path", required=True)
    ap.add_argument("--input_wavs_dir", default="LibriTTS")
    ap.add_argument("--input_training_file", default="LibriTTS/train-full.txt")
    ap.add_argument("--input_validation_file", default="LibriTTS/val-full.txt")
    ap.add_argument("--training_epochs", type=int, default=100000)
    ap.add_argument("--max_steps", type=int, default=1_000_000)
    a = ap.parse_args()
    with open(a.config) as f:
        h = AttrDict(json.load(f))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(h.seed)

    generator = BigVGAN(h).to(device)
    mpd = MultiPeriodDiscriminator(h).to(device)
    mrd = MultiResolutionDiscriminator(h).to(device)
    fn_mel_loss = MultiScaleMelSpectrogramLoss(sampling_rate=h.sampling_rate)

    steps, last_epoch, state_do = 0, -1, None
    if rank == 0:
        os.makedirs(a.checkpoint_path, exist_ok=True)
    cp_g = scan_checkpoint(a.checkpoint_path, "g_")
    cp_do = scan_checkpoint(a.checkpoint_path, "do_")
    if cp_g is not None and cp_do is not None:
        generator.load_state_dict(torch.load(cp_g, map_location="cpu")["generator"])
        state_do = torch.load(cp_do, map_location="cpu")
        mpd.load_state_dict(state_do["mpd"])
        mrd.load_state_dict(state_do["mrd"])
        steps, last_epoch = state_do["steps"] + 1, state_do["epoch"]

    generator = DDP(generator, device_ids=[local_rank])
    mpd = DDP(mpd, device_ids=[local_rank])
    mrd = DDP(mrd, device_ids=[local_rank])

    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(mrd.parameters(), mpd.parameters()), h.learning_rate,
                                betas=[h.adam_b1, h.adam_b2])
    if state_do is not None:
        optim_g.load_state_dict(state_do["optim_g"])
        optim_d.load_state_dict(state_do["optim_d"])
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)

    train_files, val_files = get_dataset_filelist(a)
    trainset = MelDataset(train_files, h, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                          h.sampling_rate, h.fmin, h.fmax, shuffle=False, fmax_loss=h.fmax_for_loss, device=None)
    sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    train_loader = DataLoader(trainset, num_workers=h.num_workers, shuffle=False, sampler=sampler,
                              batch_size=h.batch_size, pin_memory=True, drop_last=True)
    sw = None
    if rank == 0:
        validset = MelDataset(val_files, h, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                              h.sampling_rate, h.fmin, h.fmax, split=False, shuffle=False,
                              fmax_loss=h.fmax_for_loss, device=None)
        val_loader = DataLoader(validset, num_workers=1, shuffle=False, batch_size=1, pin_memory=True)
        sw = SummaryWriter(os.path.join(a.checkpoint_path, "logs"))

    for epoch in range(max(0, last_epoch), a.training_epochs):
        sampler.set_epoch(epoch)
        generator.train(); mpd.train(); mrd.train()
        t_epoch = time.time()
        for x, y, _, y_mel in train_loader:
            t_b = time.time()
            x, y, y_mel = x.to(device, non_blocking=True), y.to(device, non_blocking=True), y_mel.to(device)
            y = y.unsqueeze(1)
            y_g_hat = generator(x)

            optim_d.zero_grad()
            y_df_r, y_df_g, _, _ = mpd(y, y_g_hat.detach())
            loss_disc_f, _, _ = discriminator_loss(y_df_r, y_df_g)
            y_ds_r, y_ds_g, _, _ = mrd(y, y_g_hat.detach())
            loss_disc_s, _, _ = discriminator_loss(y_ds_r, y_ds_g)
            loss_disc_all = loss_disc_s + loss_disc_f
            loss_disc_all.backward()
            grad_norm_mpd = torch.nn.utils.clip_grad_norm_(mpd.parameters(), h.clip_grad_norm)
            grad_norm_mrd = torch.nn.utils.clip_grad_norm_(mrd.parameters(), h.clip_grad_norm)
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = fn_mel_loss(y, y_g_hat) * h.lambda_melloss
            y_df_r, y_df_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
            y_ds_r, y_ds_g, fmap_s_r, fmap_s_g = mrd(y, y_g_hat)
            loss_fm = feature_loss(fmap_f_r, fmap_f_g) + feature_loss(fmap_s_r, fmap_s_g)
            loss_gen = generator_loss(y_df_g)[0] + generator_loss(y_ds_g)[0]
            loss_gen_all = loss_gen + loss_fm + loss_mel
            loss_gen_all.backward()
            grad_norm_g = torch.nn.utils.clip_grad_norm_(generator.parameters(), 1000.0)
            optim_g.step()

            if steps % h.stdout_interval == 0:
                g_avg = reduce_tensor(loss_gen_all).item()
                mel_avg = reduce_tensor(loss_mel).item() / h.lambda_melloss
                if rank == 0:
                    print(f"Steps: {steps}, Gen Loss Total: {g_avg:.3f}, Mel Error: {mel_avg:.3f}, "
                          f"s/b: {time.time() - t_b:.3f}")
                    sw.add_scalar("training/gen_loss_total", g_avg, steps)
                    sw.add_scalar("training/mel_spec_error", mel_avg, steps)
                    sw.add_scalar("training/disc_loss_total", loss_disc_all.item(), steps)
                    sw.add_scalar("training/grad_norm_g", grad_norm_g.item(), steps)
                    sw.add_scalar("training/grad_norm_mpd", grad_norm_mpd.item(), steps)
                    sw.add_scalar("training/grad_norm_mrd", grad_norm_mrd.item(), steps)

            if rank == 0:
                if steps % h.checkpoint_interval == 0 and steps != 0:
                    save_checkpoint(f"{a.checkpoint_path}/g_{steps:08d}",
                                    {"generator": generator.module.state_dict()})
                    save_checkpoint(f"{a.checkpoint_path}/do_{steps:08d}",
                                    {"mpd": mpd.module.state_dict(), "mrd": mrd.module.state_dict(),
                                     "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                                     "steps": steps, "epoch": epoch})
                if steps % h.validation_interval == 0:
                    validate(generator.module, val_loader, h, device, sw, steps)

            steps += 1
            if steps >= a.max_steps:
                break

        sched_g.step()
        sched_d.step()
        if rank == 0:
            print(f"Time taken for epoch {epoch + 1} is {int(time.time() - t_epoch)} sec")
        if steps >= a.max_steps:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
