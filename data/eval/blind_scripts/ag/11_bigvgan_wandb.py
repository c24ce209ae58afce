"""BigVGAN-base vocoder training on LibriTTS (24 kHz), torchrun + DDP, wandb logging.

torchrun --nproc_per_node=8 11_bigvgan_wandb.py --config configs/bigvgan_base_24khz_100band.yaml
"""
import argparse
import itertools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from bigvgan import BigVGAN
from discriminators import MultiPeriodDiscriminator, MultiResolutionDiscriminator
from loss import discriminator_loss, feature_loss, generator_loss
from meldataset import MelDataset, get_dataset_filelist, mel_spectrogram


def mel_of(wav, h, fmax=None):
    return mel_spectrogram(wav.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate, h.hop_size, h.win_size,
                           h.fmin, fmax if fmax is not None else h.fmax_for_loss)


def save(path, obj):
    tmp = path + ".partial"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--checkpoint_path", default="exp/bigvgan_base")
    ap.add_argument("--resume", default="")
    args, overrides = ap.parse_known_args()
    h = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(overrides))

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(h.seed + rank)

    os.makedirs(args.checkpoint_path, exist_ok=True)
    wandb.init(project="bigvgan", name=os.path.basename(args.checkpoint_path),
               config=OmegaConf.to_container(h, resolve=True), dir=args.checkpoint_path)

    generator = BigVGAN(h).to(device)
    mpd = MultiPeriodDiscriminator(h).to(device)
    mrd = MultiResolutionDiscriminator(h).to(device)

    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(mpd.parameters(), mrd.parameters()), h.learning_rate,
                                betas=[h.adam_b1, h.adam_b2])

    steps, last_epoch = 0, -1
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        generator.load_state_dict(ckpt["generator"])
        mpd.load_state_dict(ckpt["mpd"])
        mrd.load_state_dict(ckpt["mrd"])
        optim_g.load_state_dict(ckpt["optim_g"])
        optim_d.load_state_dict(ckpt["optim_d"])
        steps, last_epoch = ckpt["steps"] + 1, ckpt["epoch"]

    generator = DDP(generator, device_ids=[local_rank])
    mpd = DDP(mpd, device_ids=[local_rank])
    mrd = DDP(mrd, device_ids=[local_rank])

    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)

    train_files, val_files = get_dataset_filelist(h)
    trainset = MelDataset(train_files, h, h.segment_size, split=True, shuffle=False, fmax_loss=h.fmax_for_loss)
    sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    loader = DataLoader(trainset, batch_size=h.batch_size, sampler=sampler, num_workers=h.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    if rank == 0:
        valset = MelDataset(val_files, h, h.segment_size, split=False, shuffle=False, fmax_loss=h.fmax_for_loss)
        val_loader = DataLoader(valset, batch_size=1, num_workers=1)

    generator.train(), mpd.train(), mrd.train()
    for epoch in range(max(0, last_epoch), h.training_epochs):
        sampler.set_epoch(epoch)
        t_epoch = time.time()
        for x, y, _, y_mel in loader:
            t0 = time.time()
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).unsqueeze(1)
            y_mel = y_mel.to(device, non_blocking=True)

            y_g_hat = generator(x)
            y_g_hat_mel = mel_of(y_g_hat, h)

            # discriminator step
            optim_d.zero_grad()
            y_df_r, y_df_g, _, _ = mpd(y, y_g_hat.detach())
            loss_disc_f, _, _ = discriminator_loss(y_df_r, y_df_g)
            y_ds_r, y_ds_g, _, _ = mrd(y, y_g_hat.detach())
            loss_disc_s, _, _ = discriminator_loss(y_ds_r, y_ds_g)
            loss_disc_all = loss_disc_s + loss_disc_f
            loss_disc_all.backward()
            grad_norm_mpd = torch.nn.utils.clip_grad_norm_(mpd.parameters(), 1000.0)
            grad_norm_mrd = torch.nn.utils.clip_grad_norm_(mrd.parameters(), 1000.0)
            optim_d.step()

            # generator step
            optim_g.zero_grad()
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
            y_df_r, y_df_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
            y_ds_r, y_ds_g, fmap_s_r, fmap_s_g = mrd(y, y_g_hat)
            loss_fm = feature_loss(fmap_f_r, fmap_f_g) + feature_loss(fmap_s_r, fmap_s_g)
            loss_gen_f, _ = generator_loss(y_df_g)
            loss_gen_s, _ = generator_loss(y_ds_g)
            loss_gen_all = loss_gen_s + loss_gen_f + loss_fm + loss_mel
            loss_gen_all.backward()
            grad_norm_g = torch.nn.utils.clip_grad_norm_(generator.parameters(), 1000.0)
            optim_g.step()

            if rank == 0 and steps % h.summary_interval == 0:
                wandb.log({
                    "train/loss_gen_all": loss_gen_all.item(),
                    "train/loss_disc_all": loss_disc_all.item(),
                    "train/mel_l1": loss_mel.item() / 45,
                    "train/fm": loss_fm.item(),
                    "train/grad_norm_g": grad_norm_g.item(),
                    "train/grad_norm_mpd": grad_norm_mpd.item(),
                    "train/grad_norm_mrd": grad_norm_mrd.item(),
                    "train/lr": sched_g.get_last_lr()[0],
                    "train/sec_per_step": time.time() - t0,
                }, step=steps)

            if rank == 0 and steps % h.checkpoint_interval == 0 and steps != 0:
                save(os.path.join(args.checkpoint_path, f"ckpt_{steps:08d}.pt"), {
                    "generator": generator.module.state_dict(),
                    "mpd": mpd.module.state_dict(), "mrd": mrd.module.state_dict(),
                    "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                    "steps": steps, "epoch": epoch})

            if rank == 0 and steps % h.validation_interval == 0:
                g = generator.module
                g.eval()
                err, n = 0.0, 0
                audios = []
                with torch.no_grad():
                    for j, (vx, vy, _, vmel) in enumerate(val_loader):
                        vy_hat = g(vx.to(device))
                        vmel_hat = mel_of(vy_hat, h)
                        t = min(vmel_hat.size(-1), vmel.size(-1))
                        err += F.l1_loss(vmel[..., :t].to(device), vmel_hat[..., :t]).item()
                        n += 1
                        if j < 4:
                            audios.append(wandb.Audio(vy_hat[0, 0].float().cpu().numpy(),
                                                      sample_rate=h.sampling_rate, caption=f"val_{j}"))
                        if n >= h.get("num_val_files", 100):
                            break
                wandb.log({"val/mel_l1": err / max(n, 1), "val/audio": audios}, step=steps)
                g.train()

            steps += 1

        sched_g.step()
        sched_d.step()
        if rank == 0:
            print(f"epoch {epoch + 1} done in {time.time() - t_epoch:.0f}s, step {steps}", flush=True)

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
