"""Singing / speaking voice conversion (so-vits-svc style): HuBERT-soft content + F0 + speaker id -> waveform.

torchrun --nproc_per_node=4 13_sovits_vc.py -c configs/svc_44k.json -n svc_opencpop_m4
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import commons
import utils
from data_utils import DistributedBucketSampler, TextAudioCollate, TextAudioSpeakerLoader
from losses import discriminator_loss, feature_loss, generator_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from models import MultiPeriodDiscriminator, SynthesizerTrn


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", required=True)
    p.add_argument("-n", "--name", required=True, help="run name, also the log dir under ./logs")
    p.add_argument("--wandb_project", default="svc")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def main():
    args = get_args()
    hps = utils.get_hparams_from_file(args.config)
    model_dir = os.path.join("logs", args.name)

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(hps.train.seed)

    run = wandb.init(project=args.wandb_project, name=args.name, config=hps.to_dict(),
                     dir=model_dir, resume="allow" if args.resume else None)

    train_dataset = TextAudioSpeakerLoader(hps.data.training_files, hps)
    sampler = DistributedBucketSampler(train_dataset, hps.train.batch_size,
                                       [150, 300, 450, 600, 750, 900, 1050, 1200],
                                       num_replicas=world_size, rank=rank, shuffle=True)
    collate_fn = TextAudioCollate()
    train_loader = DataLoader(train_dataset, num_workers=4, shuffle=False, pin_memory=True,
                              collate_fn=collate_fn, batch_sampler=sampler)
    eval_loader = None
    if rank == 0:
        os.makedirs(model_dir, exist_ok=True)
        eval_dataset = TextAudioSpeakerLoader(hps.data.validation_files, hps, all_in_mem=True)
        eval_loader = DataLoader(eval_dataset, num_workers=1, shuffle=False, batch_size=1,
                                 pin_memory=False, drop_last=False, collate_fn=collate_fn)

    net_g = SynthesizerTrn(hps.data.filter_length // 2 + 1, hps.train.segment_size // hps.data.hop_length,
                           **hps.model).to(device)
    net_d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).to(device)
    optim_g = torch.optim.AdamW(net_g.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)
    optim_d = torch.optim.AdamW(net_d.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)

    epoch_str, global_step = 1, 0
    if args.resume:
        try:
            _, _, _, epoch_str = utils.load_checkpoint(utils.latest_checkpoint_path(model_dir, "G_*.pth"),
                                                       net_g, optim_g)
            _, _, _, epoch_str = utils.load_checkpoint(utils.latest_checkpoint_path(model_dir, "D_*.pth"),
                                                       net_d, optim_d)
            epoch_str = max(epoch_str, 1)
            global_step = (epoch_str - 1) * len(train_loader)
        except Exception as e:
            print(f"[rank {rank}] could not resume: {e}")

    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])
    scheduler_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=hps.train.lr_decay, last_epoch=epoch_str - 2)
    scheduler_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=hps.train.lr_decay, last_epoch=epoch_str - 2)
    scaler = GradScaler(enabled=hps.train.fp16_run)
    hop, seg = hps.data.hop_length, hps.train.segment_size

    for epoch in range(epoch_str, hps.train.epochs + 1):
        sampler.set_epoch(epoch)
        net_g.train(); net_d.train()
        t0 = time.time()
        for batch_idx, items in enumerate(train_loader):
            c, f0, spec, y, spk, lengths, uv, volume = [t.to(device, non_blocking=True) if t is not None else None
                                                         for t in items]
            mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                                    hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)

            with autocast(enabled=hps.train.fp16_run):
                y_hat, ids_slice, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q), pred_lf0, norm_lf0, lf0 = \
                    net_g(c, f0, uv, spec, g=spk, c_lengths=lengths, spec_lengths=lengths, vol=volume)
                y_mel = commons.slice_segments(mel, ids_slice, seg // hop)
                y_hat_mel = mel_spectrogram_torch(y_hat.squeeze(1), hps.data.filter_length,
                                                  hps.data.n_mel_channels, hps.data.sampling_rate, hop,
                                                  hps.data.win_length, hps.data.mel_fmin, hps.data.mel_fmax)
                y = commons.slice_segments(y, ids_slice * hop, seg)
                y_d_hat_r, y_d_hat_g, _, _ = net_d(y, y_hat.detach())
                with autocast(enabled=False):
                    loss_disc, _, _ = discriminator_loss(y_d_hat_r, y_d_hat_g)
            optim_d.zero_grad()
            scaler.scale(loss_disc).backward()
            scaler.unscale_(optim_d)
            grad_norm_d = commons.clip_grad_value_(net_d.parameters(), None)
            scaler.step(optim_d)

            with autocast(enabled=hps.train.fp16_run):
                y_d_hat_r, y_d_hat_g, fmap_r, fmap_g = net_d(y, y_hat)
                with autocast(enabled=False):
                    loss_mel = F.l1_loss(y_mel, y_hat_mel) * hps.train.c_mel
                    loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * hps.train.c_kl
                    loss_fm = feature_loss(fmap_r, fmap_g)
                    loss_gen, _ = generator_loss(y_d_hat_g)
                    loss_lf0 = F.mse_loss(pred_lf0, lf0)
                    loss_gen_all = loss_gen + loss_fm + loss_mel + loss_kl + loss_lf0
            optim_g.zero_grad()
            scaler.scale(loss_gen_all).backward()
            scaler.unscale_(optim_g)
            grad_norm_g = commons.clip_grad_value_(net_g.parameters(), None)
            scaler.step(optim_g)
            scaler.update()

            if global_step % hps.train.log_interval == 0:
                wandb.log({"loss/g/total": loss_gen_all.item(), "loss/d/total": loss_disc.item(),
                           "loss/g/fm": loss_fm.item(), "loss/g/mel": loss_mel.item(),
                           "loss/g/kl": loss_kl.item(), "loss/g/lf0": loss_lf0.item(),
                           "grad_norm_g": grad_norm_g, "grad_norm_d": grad_norm_d,
                           "lr": optim_g.param_groups[0]["lr"], "epoch": epoch}, step=global_step)

            if rank == 0 and global_step % hps.train.eval_interval == 0:
                evaluate(hps, net_g.module, eval_loader, global_step, device)
                utils.save_checkpoint(net_g.module, optim_g, hps.train.learning_rate, epoch,
                                      os.path.join(model_dir, f"G_{global_step}.pth"))
                utils.save_checkpoint(net_d.module, optim_d, hps.train.learning_rate, epoch,
                                      os.path.join(model_dir, f"D_{global_step}.pth"))
                keep = getattr(hps.train, "keep_ckpts", 3)
                if keep > 0:
                    utils.clean_checkpoints(path_to_models=model_dir, n_ckpts_to_keep=keep, sort_by_time=True)
            global_step += 1

        scheduler_g.step()
        scheduler_d.step()
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.1f}s, step {global_step}")

    run.finish()
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(hps, generator, eval_loader, step, device):
    generator.eval()
    audios, images = {}, {}
    for i, items in enumerate(eval_loader):
        c, f0, spec, y, spk, _, uv, volume = [t.to(device) if t is not None else None for t in items]
        mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                                hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)
        y_hat, _ = generator.infer(c, f0, uv, g=spk, vol=volume)
        y_hat_mel = mel_spectrogram_torch(y_hat.squeeze(1).float(), hps.data.filter_length,
                                          hps.data.n_mel_channels, hps.data.sampling_rate, hps.data.hop_length,
                                          hps.data.win_length, hps.data.mel_fmin, hps.data.mel_fmax)
        audios[f"eval/gen_{i}"] = wandb.Audio(y_hat[0, 0].float().cpu().numpy(), sample_rate=hps.data.sampling_rate)
        audios[f"eval/gt_{i}"] = wandb.Audio(y[0, 0].cpu().numpy(), sample_rate=hps.data.sampling_rate)
        images[f"eval/mel_{i}"] = wandb.Image(utils.plot_spectrogram_to_numpy(
            torch.cat([mel, y_hat_mel[..., :mel.size(-1)]], 1)[0].cpu().numpy()))
        if i >= 4:
            break
    wandb.log({**audios, **images}, step=step)
    generator.train()


if __name__ == "__main__":
    main()
