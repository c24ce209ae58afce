# Multi-speaker VITS on VCTK, launched with torchrun.
import os
import argparse
import logging
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from torch.cuda.amp import autocast, GradScaler

import commons
import utils
from data_utils import TextAudioSpeakerLoader, TextAudioSpeakerCollate, DistributedBucketSampler
from models import SynthesizerTrn, MultiPeriodDiscriminator
from losses import generator_loss, discriminator_loss, feature_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from text.symbols import symbols

logging.getLogger("matplotlib").setLevel(logging.WARNING)
torch.backends.cudnn.benchmark = True


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default="configs/vctk_base.json")
    p.add_argument("-m", "--model", required=True, help="experiment name under ./logs")
    p.add_argument("--max_steps", type=int, default=800_000)
    return p.parse_args()


def to_cuda(tensors, device):
    return [t.to(device, non_blocking=True) for t in tensors]


@torch.no_grad()
def evaluate(hps, net_g, eval_loader, writer, step, device):
    net_g.eval()
    x, x_lengths, spec, spec_lengths, y, y_lengths, speakers = to_cuda(next(iter(eval_loader)), device)
    x, x_lengths = x[:1], x_lengths[:1]
    spec, spec_lengths = spec[:1], spec_lengths[:1]
    y, y_lengths = y[:1], y_lengths[:1]
    speakers = speakers[:1]

    y_hat, attn, mask, *_ = net_g.infer(x, x_lengths, speakers, noise_scale=0.667, max_len=1000)
    y_hat_lengths = mask.sum([1, 2]).long() * hps.data.hop_length

    mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                            hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)
    y_hat_mel = mel_spectrogram_torch(y_hat.squeeze(1).float(), hps.data.filter_length, hps.data.n_mel_channels,
                                      hps.data.sampling_rate, hps.data.hop_length, hps.data.win_length,
                                      hps.data.mel_fmin, hps.data.mel_fmax)
    writer.add_image("gen/mel", utils.plot_spectrogram_to_numpy(y_hat_mel[0].cpu().numpy()), step, dataformats="HWC")
    writer.add_image("gt/mel", utils.plot_spectrogram_to_numpy(mel[0].cpu().numpy()), step, dataformats="HWC")
    writer.add_audio("gen/audio", y_hat[0, :, :y_hat_lengths[0]], step, hps.data.sampling_rate)
    writer.add_audio("gt/audio", y[0, :, :y_lengths[0]], step, hps.data.sampling_rate)
    net_g.train()


def main():
    args = parse_args()
    hps = utils.get_hparams_from_file(args.config)
    model_dir = os.path.join("./logs", args.model)

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(hps.train.seed)

    logger, writer, writer_eval = None, None, None
    if rank == 0:
        os.makedirs(model_dir, exist_ok=True)
        logger = utils.get_logger(model_dir)
        logger.info(hps)
        writer = SummaryWriter(model_dir)
        writer_eval = SummaryWriter(os.path.join(model_dir, "eval"))

    train_dataset = TextAudioSpeakerLoader(hps.data.training_files, hps.data)
    train_sampler = DistributedBucketSampler(
        train_dataset, hps.train.batch_size, [32, 300, 400, 500, 600, 700, 800, 900, 1000],
        num_replicas=world_size, rank=rank, shuffle=True)
    collate_fn = TextAudioSpeakerCollate()
    train_loader = DataLoader(train_dataset, num_workers=8, shuffle=False, pin_memory=True,
                              collate_fn=collate_fn, batch_sampler=train_sampler, persistent_workers=True)
    if rank == 0:
        eval_dataset = TextAudioSpeakerLoader(hps.data.validation_files, hps.data)
        eval_loader = DataLoader(eval_dataset, num_workers=0, shuffle=False, batch_size=hps.train.batch_size,
                                 pin_memory=True, drop_last=False, collate_fn=collate_fn)

    net_g = SynthesizerTrn(len(symbols), hps.data.filter_length // 2 + 1,
                           hps.train.segment_size // hps.data.hop_length,
                           n_speakers=hps.data.n_speakers, **hps.model).to(device)
    net_d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).to(device)
    optim_g = torch.optim.AdamW(net_g.parameters(), hps.train.learning_rate, betas=hps.train.betas,
                                eps=hps.train.eps)
    optim_d = torch.optim.AdamW(net_d.parameters(), hps.train.learning_rate, betas=hps.train.betas,
                                eps=hps.train.eps)

    epoch_start, global_step = 1, 0
    try:
        _, _, _, epoch_start = utils.load_checkpoint(utils.latest_checkpoint_path(model_dir, "G_*.pth"),
                                                     net_g, optim_g)
        _, _, _, epoch_start = utils.load_checkpoint(utils.latest_checkpoint_path(model_dir, "D_*.pth"),
                                                     net_d, optim_d)
        global_step = (epoch_start - 1) * len(train_loader)
    except Exception:
        pass

    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])

    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=hps.train.lr_decay, last_epoch=epoch_start - 2)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=hps.train.lr_decay, last_epoch=epoch_start - 2)
    scaler = GradScaler(enabled=hps.train.fp16_run)
    hop, seg = hps.data.hop_length, hps.train.segment_size

    for epoch in range(epoch_start, hps.train.epochs + 1):
        train_sampler.set_epoch(epoch)
        net_g.train()
        net_d.train()
        t0 = time.time()
        for batch_idx, batch in enumerate(train_loader):
            x, x_lengths, spec, spec_lengths, y, y_lengths, speakers = to_cuda(batch, device)

            with autocast(enabled=hps.train.fp16_run):
                y_hat, l_length, attn, ids_slice, x_mask, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q) = \
                    net_g(x, x_lengths, spec, spec_lengths, speakers)
                mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                                        hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)
                y_mel = commons.slice_segments(mel, ids_slice, seg // hop)
                y_hat_mel = mel_spectrogram_torch(y_hat.squeeze(1), hps.data.filter_length, hps.data.n_mel_channels,
                                                  hps.data.sampling_rate, hop, hps.data.win_length,
                                                  hps.data.mel_fmin, hps.data.mel_fmax)
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
                    loss_dur = torch.sum(l_length.float())
                    loss_mel = F.l1_loss(y_mel, y_hat_mel) * hps.train.c_mel
                    loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * hps.train.c_kl
                    loss_fm = feature_loss(fmap_r, fmap_g)
                    loss_gen, _ = generator_loss(y_d_hat_g)
                    loss_gen_all = loss_gen + loss_fm + loss_mel + loss_dur + loss_kl
            optim_g.zero_grad()
            scaler.scale(loss_gen_all).backward()
            scaler.unscale_(optim_g)
            grad_norm_g = commons.clip_grad_value_(net_g.parameters(), None)
            scaler.step(optim_g)
            scaler.update()

            if rank == 0:
                if global_step % hps.train.log_interval == 0:
                    lr = optim_g.param_groups[0]["lr"]
                    logger.info(f"epoch {epoch} step {global_step} d={loss_disc.item():.3f} "
                                f"g={loss_gen.item():.3f} fm={loss_fm.item():.3f} mel={loss_mel.item():.3f} "
                                f"dur={loss_dur.item():.3f} kl={loss_kl.item():.3f} lr={lr:.2e}")
                    for k, v in {"loss/g/total": loss_gen_all, "loss/d/total": loss_disc,
                                 "loss/g/mel": loss_mel, "loss/g/kl": loss_kl, "loss/g/fm": loss_fm,
                                 "loss/g/dur": loss_dur, "grad_norm_g": grad_norm_g,
                                 "grad_norm_d": grad_norm_d, "learning_rate": lr}.items():
                        writer.add_scalar(k, v, global_step)
                if global_step % hps.train.eval_interval == 0:
                    evaluate(hps, net_g, eval_loader, writer_eval, global_step, device)
                    utils.save_checkpoint(net_g.module, optim_g, hps.train.learning_rate, epoch,
                                          os.path.join(model_dir, f"G_{global_step}.pth"))
                    utils.save_checkpoint(net_d.module, optim_d, hps.train.learning_rate, epoch,
                                          os.path.join(model_dir, f"D_{global_step}.pth"))
            global_step += 1
            if global_step >= args.max_steps:
                break

        sched_g.step()
        sched_d.step()
        if rank == 0:
            logger.info(f"====> Epoch {epoch} took {time.time() - t0:.1f}s")
        if global_step >= args.max_steps:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
