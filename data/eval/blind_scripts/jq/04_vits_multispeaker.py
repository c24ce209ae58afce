"""Multi-speaker VITS (VCTK / LibriTTS-R), torchrun launch.

    torchrun --standalone --nproc_per_node=8 04_vits_multispeaker.py -c configs/vctk_base.json -m vctk_ms
"""
import argparse
import glob
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.cuda.amp import GradScaler, autocast
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

import commons
import utils
from data_utils import (DistributedBucketSampler, TextAudioSpeakerCollate,
                        TextAudioSpeakerLoader)
from losses import discriminator_loss, feature_loss, generator_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from models import MultiPeriodDiscriminator, SynthesizerTrn
from text.symbols import symbols

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("vits")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", required=True)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--log_root", default="./logs")
    return p.parse_args()


def mel_of(hps, wav):
    return mel_spectrogram_torch(wav.squeeze(1).float(), hps.data.filter_length, hps.data.n_mel_channels,
                                 hps.data.sampling_rate, hps.data.hop_length, hps.data.win_length,
                                 hps.data.mel_fmin, hps.data.mel_fmax)


def main():
    args = parse_args()
    with open(args.config) as f:
        config = json.load(f)
    hps = utils.HParams(**config)
    hps.model_dir = os.path.join(args.log_root, args.model)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(hps.train.seed)

    writer = writer_eval = None
    if rank == 0:
        os.makedirs(hps.model_dir, exist_ok=True)
        with open(os.path.join(hps.model_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        writer = SummaryWriter(hps.model_dir)
        writer_eval = SummaryWriter(os.path.join(hps.model_dir, "eval"))

    train_set = TextAudioSpeakerLoader(hps.data.training_files, hps.data)
    sampler = DistributedBucketSampler(train_set, hps.train.batch_size,
                                       [32, 300, 400, 500, 600, 700, 800, 900, 1000],
                                       num_replicas=world_size, rank=rank, shuffle=True)
    collate = TextAudioSpeakerCollate()
    train_loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=collate,
                              num_workers=8, pin_memory=True, persistent_workers=True)
    eval_loader = None
    if rank == 0:
        eval_set = TextAudioSpeakerLoader(hps.data.validation_files, hps.data)
        eval_loader = DataLoader(eval_set, batch_size=1, shuffle=False, collate_fn=collate, num_workers=2)

    net_g = SynthesizerTrn(len(symbols), hps.data.filter_length // 2 + 1,
                           hps.train.segment_size // hps.data.hop_length,
                           n_speakers=hps.data.n_speakers, **hps.model).to(device)
    net_d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).to(device)
    optim_g = torch.optim.AdamW(net_g.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)
    optim_d = torch.optim.AdamW(net_d.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)

    epoch_start, step = 1, 0
    g_paths = sorted(glob.glob(os.path.join(hps.model_dir, "G_*.pth")),
                     key=lambda p: int(os.path.basename(p)[2:-4]))
    g_path = g_paths[-1] if g_paths else None
    if g_path:
        ckpt_g = torch.load(g_path, map_location="cpu")
        ckpt_d = torch.load(g_path.replace("G_", "D_"), map_location="cpu")
        net_g.load_state_dict(ckpt_g["model"])
        net_d.load_state_dict(ckpt_d["model"])
        optim_g.load_state_dict(ckpt_g["optimizer"])
        optim_d.load_state_dict(ckpt_d["optimizer"])
        epoch_start, step = ckpt_g["epoch"] + 1, ckpt_g["step"]
        if rank == 0:
            log.info("resumed from %s (epoch %d, step %d)", g_path, epoch_start - 1, step)

    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, hps.train.lr_decay, last_epoch=epoch_start - 2)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, hps.train.lr_decay, last_epoch=epoch_start - 2)
    scaler = GradScaler(enabled=hps.train.fp16_run)
    seg_frames = hps.train.segment_size // hps.data.hop_length

    for epoch in range(epoch_start, hps.train.epochs + 1):
        sampler.set_epoch(epoch)
        net_g.train()
        net_d.train()
        t0 = time.time()
        for x, x_len, spec, spec_len, y, y_len, sid in train_loader:
            x, x_len = x.to(device, non_blocking=True), x_len.to(device, non_blocking=True)
            spec, spec_len = spec.to(device, non_blocking=True), spec_len.to(device, non_blocking=True)
            y, sid = y.to(device, non_blocking=True), sid.to(device, non_blocking=True)

            with autocast(enabled=hps.train.fp16_run):
                (y_hat, l_length, attn, ids_slice, x_mask, z_mask,
                 (z, z_p, m_p, logs_p, m_q, logs_q)) = net_g(x, x_len, spec, spec_len, sid=sid)
                mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                                        hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)
                y_mel = commons.slice_segments(mel, ids_slice, seg_frames)
                y_hat_mel = mel_of(hps, y_hat)
                y = commons.slice_segments(y, ids_slice * hps.data.hop_length, hps.train.segment_size)

                d_real, d_fake, _, _ = net_d(y, y_hat.detach())
                with autocast(enabled=False):
                    loss_disc, _, _ = discriminator_loss(d_real, d_fake)
            optim_d.zero_grad(set_to_none=True)
            scaler.scale(loss_disc).backward()
            scaler.unscale_(optim_d)
            commons.clip_grad_value_(net_d.parameters(), None)
            scaler.step(optim_d)

            with autocast(enabled=hps.train.fp16_run):
                d_real, d_fake, fmap_r, fmap_g = net_d(y, y_hat)
                with autocast(enabled=False):
                    loss_dur = torch.sum(l_length.float())
                    loss_mel = F.l1_loss(y_mel, y_hat_mel) * hps.train.c_mel
                    loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * hps.train.c_kl
                    loss_fm = feature_loss(fmap_r, fmap_g)
                    loss_gen, _ = generator_loss(d_fake)
                    loss_g = loss_gen + loss_fm + loss_mel + loss_dur + loss_kl
            optim_g.zero_grad(set_to_none=True)
            scaler.scale(loss_g).backward()
            scaler.unscale_(optim_g)
            commons.clip_grad_value_(net_g.parameters(), None)
            scaler.step(optim_g)
            scaler.update()

            if rank == 0 and step % hps.train.log_interval == 0:
                log.info("ep %d step %d | d %.3f g %.3f fm %.3f mel %.3f dur %.3f kl %.3f",
                         epoch, step, loss_disc.item(), loss_gen.item(), loss_fm.item(),
                         loss_mel.item(), loss_dur.item(), loss_kl.item())
                for k, v in {"d/total": loss_disc, "g/total": loss_g, "g/fm": loss_fm, "g/mel": loss_mel,
                             "g/dur": loss_dur, "g/kl": loss_kl}.items():
                    writer.add_scalar("loss/" + k, v.item(), step)
                writer.add_scalar("lr", optim_g.param_groups[0]["lr"], step)

            if rank == 0 and step % hps.train.eval_interval == 0:
                evaluate(hps, net_g, eval_loader, writer_eval, step, device)
                save(hps, net_g.module, optim_g, epoch, step, "G")
                save(hps, net_d.module, optim_d, epoch, step, "D")
            step += 1

        sched_g.step()
        sched_d.step()
        if rank == 0:
            log.info("epoch %d done in %.1fs", epoch, time.time() - t0)

    dist.destroy_process_group()


def save(hps, model, optim, epoch, step, prefix):
    path = os.path.join(hps.model_dir, f"{prefix}_{step}.pth")
    torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(),
                "epoch": epoch, "step": step}, path)


@torch.no_grad()
def evaluate(hps, net_g, loader, writer, step, device, n_utts=4):
    net_g.eval()
    for i, (x, x_len, spec, spec_len, y, y_len, sid) in enumerate(loader):
        if i >= n_utts:
            break
        x, x_len, sid = x.to(device), x_len.to(device), sid.to(device)
        y_hat, attn, mask, *_ = net_g.infer(x, x_len, sid=sid, noise_scale=0.667,
                                            length_scale=1.0, noise_scale_w=0.8, max_len=1000)
        y_hat_len = int(mask.sum().item()) * hps.data.hop_length
        y_hat_mel = mel_of(hps, y_hat)
        writer.add_audio(f"gen/audio_{i}", y_hat[0, :, :y_hat_len].cpu(), step, hps.data.sampling_rate)
        writer.add_image(f"gen/mel_{i}", utils.plot_spectrogram_to_numpy(y_hat_mel[0].cpu().numpy()),
                         step, dataformats="HWC")
        if step == 0:
            writer.add_audio(f"gt/audio_{i}", y[0, :, :y_len[0]], step, hps.data.sampling_rate)
    net_g.train()


if __name__ == "__main__":
    main()
