"""VITS for Mandarin (pinyin phonemes + tones), multi-speaker, stochastic duration predictor.

torchrun --nproc_per_node=8 16_vits_zh.py -c configs/zh_ms.json -m zh_ms_base
"""
import argparse
import glob
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

import commons
import utils
from data_utils import DistributedBucketSampler, TextAudioSpeakerCollate, TextAudioSpeakerLoader
from losses import discriminator_loss, feature_loss, generator_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from models import MultiPeriodDiscriminator, SynthesizerTrn
from text.symbols import symbols, num_tones

logger = logging.getLogger(__name__)


def save_ckpt(model, optimizer, lr, epoch, step, model_dir, prefix, keep=5):
    path = os.path.join(model_dir, f"{prefix}_{step}.pth")
    torch.save({"model": model.state_dict(), "iteration": epoch, "optimizer": optimizer.state_dict(),
                "learning_rate": lr}, path)
    old = sorted(glob.glob(os.path.join(model_dir, f"{prefix}_*.pth")),
                 key=lambda p: int(os.path.basename(p).split("_")[1].split(".")[0]))
    for p in old[:-keep]:
        os.remove(p)


def load_ckpt(model, optimizer, path):
    ckpt = torch.load(path, map_location="cpu")
    model.load_state_dict(ckpt["model"])
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt["iteration"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-m", "--model", required=True)
    args = ap.parse_args()
    hps = utils.get_hparams_from_file(args.config)
    model_dir = os.path.join("logs", args.model)
    os.makedirs(model_dir, exist_ok=True)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(hps.train.seed)

    writer = writer_eval = None
    if rank == 0:
        logging.basicConfig(level=logging.INFO)
        logger.info(hps)
        writer = SummaryWriter(model_dir)
        writer_eval = SummaryWriter(os.path.join(model_dir, "eval"))

    train_set = TextAudioSpeakerLoader(hps.data.training_files, hps.data)
    sampler = DistributedBucketSampler(train_set, hps.train.batch_size, [32, 300, 400, 500, 600, 700, 800, 900, 1000],
                                       num_replicas=world, rank=rank, shuffle=True)
    collate = TextAudioSpeakerCollate()
    train_loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=collate, num_workers=8,
                              pin_memory=True, persistent_workers=True)
    if rank == 0:
        eval_set = TextAudioSpeakerLoader(hps.data.validation_files, hps.data)
        eval_loader = DataLoader(eval_set, batch_size=1, shuffle=False, collate_fn=collate, num_workers=0)

    net_g = SynthesizerTrn(len(symbols), hps.data.filter_length // 2 + 1, hps.train.segment_size // hps.data.hop_length,
                           n_speakers=hps.data.n_speakers, num_tones=num_tones, **hps.model).to(device)
    net_d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).to(device)
    optim_g = torch.optim.AdamW(net_g.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)
    optim_d = torch.optim.AdamW(net_d.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)

    epoch_str, global_step = 1, 0
    g_ckpts = glob.glob(os.path.join(model_dir, "G_*.pth"))
    if g_ckpts:
        latest = max(g_ckpts, key=lambda p: int(os.path.basename(p).split("_")[1].split(".")[0]))
        step_str = os.path.basename(latest).split("_")[1].split(".")[0]
        epoch_str = load_ckpt(net_g, optim_g, latest)
        load_ckpt(net_d, optim_d, os.path.join(model_dir, f"D_{step_str}.pth"))
        global_step = int(step_str)
        epoch_str += 1

    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, hps.train.lr_decay, last_epoch=epoch_str - 2)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, hps.train.lr_decay, last_epoch=epoch_str - 2)
    scaler = GradScaler(enabled=hps.train.fp16_run)
    hop, seg = hps.data.hop_length, hps.train.segment_size

    for epoch in range(epoch_str, hps.train.epochs + 1):
        sampler.set_epoch(epoch)
        net_g.train(); net_d.train()
        for x, x_len, tone, spec, spec_len, y, y_len, sid in train_loader:
            x, x_len, tone = x.to(device), x_len.to(device), tone.to(device)
            spec, spec_len, y, sid = spec.to(device), spec_len.to(device), y.to(device), sid.to(device)

            with autocast(enabled=hps.train.fp16_run):
                y_hat, l_length, attn, ids_slice, x_mask, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q) = \
                    net_g(x, x_len, tone, spec, spec_len, sid)
                mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                                        hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)
                y_mel = commons.slice_segments(mel, ids_slice, seg // hop)
                y_hat_mel = mel_spectrogram_torch(y_hat.squeeze(1), hps.data.filter_length, hps.data.n_mel_channels,
                                                  hps.data.sampling_rate, hop, hps.data.win_length,
                                                  hps.data.mel_fmin, hps.data.mel_fmax)
                y = commons.slice_segments(y, ids_slice * hop, seg)
                y_d_r, y_d_g, _, _ = net_d(y, y_hat.detach())
                with autocast(enabled=False):
                    loss_disc, _, _ = discriminator_loss(y_d_r, y_d_g)
            optim_d.zero_grad()
            scaler.scale(loss_disc).backward()
            scaler.unscale_(optim_d)
            commons.clip_grad_value_(net_d.parameters(), None)
            scaler.step(optim_d)

            with autocast(enabled=hps.train.fp16_run):
                y_d_r, y_d_g, fmap_r, fmap_g = net_d(y, y_hat)
                with autocast(enabled=False):
                    loss_dur = torch.sum(l_length.float())
                    loss_mel = F.l1_loss(y_mel, y_hat_mel) * hps.train.c_mel
                    loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * hps.train.c_kl
                    loss_fm = feature_loss(fmap_r, fmap_g)
                    loss_gen, _ = generator_loss(y_d_g)
                    loss_gen_all = loss_gen + loss_fm + loss_mel + loss_dur + loss_kl
            optim_g.zero_grad()
            scaler.scale(loss_gen_all).backward()
            scaler.unscale_(optim_g)
            grad_norm_g = commons.clip_grad_value_(net_g.parameters(), None)
            scaler.step(optim_g)
            scaler.update()

            if rank == 0 and global_step % hps.train.log_interval == 0:
                logger.info(f"epoch {epoch} step {global_step}: g {loss_gen_all.item():.3f} "
                            f"d {loss_disc.item():.3f} mel {loss_mel.item():.3f} kl {loss_kl.item():.3f}")
                writer.add_scalar("loss/g/total", loss_gen_all.item(), global_step)
                writer.add_scalar("loss/g/mel", loss_mel.item(), global_step)
                writer.add_scalar("loss/g/dur", loss_dur.item(), global_step)
                writer.add_scalar("loss/g/kl", loss_kl.item(), global_step)
                writer.add_scalar("loss/d/total", loss_disc.item(), global_step)
                writer.add_scalar("grad_norm_g", grad_norm_g, global_step)
                writer.add_scalar("learning_rate", optim_g.param_groups[0]["lr"], global_step)

            if global_step % hps.train.eval_interval == 0:
                if rank == 0:
                    evaluate(hps, net_g.module, eval_loader, writer_eval, global_step, device)
                save_ckpt(net_g.module, optim_g, hps.train.learning_rate, epoch, global_step, model_dir, "G")
                save_ckpt(net_d.module, optim_d, hps.train.learning_rate, epoch, global_step, model_dir, "D")
            global_step += 1

        sched_g.step()
        sched_d.step()

    dist.destroy_process_group()


@torch.no_grad()
def evaluate(hps, generator, eval_loader, writer, step, device):
    generator.eval()
    for i, (x, x_len, tone, spec, spec_len, y, y_len, sid) in enumerate(eval_loader):
        if i >= 4:
            break
        x, x_len, tone, sid = x.to(device), x_len.to(device), tone.to(device), sid.to(device)
        y_hat, attn, mask, *_ = generator.infer(x, x_len, tone, sid=sid, noise_scale=0.667, length_scale=1.0,
                                                max_len=1000)
        n = int(mask.sum()) * hps.data.hop_length
        writer.add_audio(f"gen/audio_{i}", y_hat[0, :, :n].float().cpu(), step, hps.data.sampling_rate)
        if step == 0:
            writer.add_audio(f"gt/audio_{i}", y[0, :, :y_len[0]], step, hps.data.sampling_rate)
        y_hat_mel = mel_spectrogram_torch(y_hat.squeeze(1).float(), hps.data.filter_length, hps.data.n_mel_channels,
                                          hps.data.sampling_rate, hps.data.hop_length, hps.data.win_length,
                                          hps.data.mel_fmin, hps.data.mel_fmax)
        writer.add_image(f"gen/mel_{i}", utils.plot_spectrogram_to_numpy(y_hat_mel[0].cpu().numpy()), step,
                         dataformats="HWC")
    generator.train()


if __name__ == "__main__":
    main()
