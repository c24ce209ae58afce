"""VITS on VCTK with the stochastic duration predictor.

Single node, one process per visible GPU (mp.spawn):
    CUDA_VISIBLE_DEVICES=0,1,2,3 python 08_vits_vctk_sdp.py -c configs/vctk_sdp.json -m vctk_sdp
"""
import argparse
import glob
import json
import os
import re

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.cuda.amp import GradScaler, autocast
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

import commons
import utils
from data_utils import DistributedBucketSampler, TextAudioSpeakerCollate, TextAudioSpeakerLoader
from losses import discriminator_loss, feature_loss, generator_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from models import MultiPeriodDiscriminator, SynthesizerTrn
from text.symbols import symbols

torch.backends.cudnn.benchmark = True


def latest_ckpt(model_dir, prefix):
    paths = glob.glob(os.path.join(model_dir, f"{prefix}_*.pth"))
    if not paths:
        return None
    return max(paths, key=lambda p: int(re.findall(r"(\d+)\.pth$", p)[0]))


def load_ckpt(path, model, optim):
    ckpt = torch.load(path, map_location="cpu")
    model.load_state_dict(ckpt["model"])
    if optim is not None and ckpt.get("optimizer") is not None:
        optim.load_state_dict(ckpt["optimizer"])
    return ckpt["iteration"], ckpt["epoch"]


def save_ckpt(path, model, optim, iteration, epoch):
    torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(),
                "iteration": iteration, "epoch": epoch}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--port", default="29511")
    args = ap.parse_args()

    with open(args.config) as f:
        config = json.load(f)
    hps = utils.HParams(**config)
    hps.model_dir = os.path.join("logs", args.model)
    os.makedirs(hps.model_dir, exist_ok=True)
    with open(os.path.join(hps.model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    n_gpus = torch.cuda.device_count()
    assert n_gpus >= 1, "needs at least one GPU"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    mp.spawn(run, args=(n_gpus, hps), nprocs=n_gpus, join=True)


def run(rank, n_gpus, hps):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", world_size=n_gpus, rank=rank)
    torch.manual_seed(hps.train.seed)
    device = torch.device("cuda", rank)

    logger = writer = writer_eval = None
    if rank == 0:
        logger = utils.get_logger(hps.model_dir)
        writer = SummaryWriter(hps.model_dir)
        writer_eval = SummaryWriter(os.path.join(hps.model_dir, "eval"))

    train_set = TextAudioSpeakerLoader(hps.data.training_files, hps.data)
    train_sampler = DistributedBucketSampler(train_set, hps.train.batch_size,
                                             [32, 300, 400, 500, 600, 700, 800, 900, 1000],
                                             num_replicas=n_gpus, rank=rank, shuffle=True)
    collate = TextAudioSpeakerCollate()
    train_loader = DataLoader(train_set, num_workers=8, shuffle=False, pin_memory=True,
                              collate_fn=collate, batch_sampler=train_sampler)
    eval_loader = None
    if rank == 0:
        eval_set = TextAudioSpeakerLoader(hps.data.validation_files, hps.data)
        eval_loader = DataLoader(eval_set, num_workers=2, shuffle=False, batch_size=1,
                                 pin_memory=True, drop_last=False, collate_fn=collate)

    net_g = SynthesizerTrn(len(symbols), hps.data.filter_length // 2 + 1,
                           hps.train.segment_size // hps.data.hop_length,
                           n_speakers=hps.data.n_speakers, use_sdp=True, **hps.model).to(device)
    net_d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).to(device)
    optim_g = torch.optim.AdamW(net_g.parameters(), hps.train.learning_rate,
                                betas=hps.train.betas, eps=hps.train.eps)
    optim_d = torch.optim.AdamW(net_d.parameters(), hps.train.learning_rate,
                                betas=hps.train.betas, eps=hps.train.eps)

    epoch_str, global_step = 1, 0
    g_path, d_path = latest_ckpt(hps.model_dir, "G"), latest_ckpt(hps.model_dir, "D")
    if g_path and d_path:
        global_step, epoch_str = load_ckpt(g_path, net_g, optim_g)
        load_ckpt(d_path, net_d, optim_d)
        epoch_str += 1

    net_g = DDP(net_g, device_ids=[rank])
    net_d = DDP(net_d, device_ids=[rank])
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=hps.train.lr_decay, last_epoch=epoch_str - 2)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=hps.train.lr_decay, last_epoch=epoch_str - 2)
    scaler = GradScaler(enabled=hps.train.fp16_run)
    seg = hps.train.segment_size // hps.data.hop_length

    for epoch in range(epoch_str, hps.train.epochs + 1):
        train_loader.batch_sampler.set_epoch(epoch)
        net_g.train()
        net_d.train()
        for batch_idx, (x, x_len, spec, spec_len, y, y_len, sid) in enumerate(train_loader):
            x, x_len = x.to(device, non_blocking=True), x_len.to(device, non_blocking=True)
            spec, spec_len = spec.to(device, non_blocking=True), spec_len.to(device, non_blocking=True)
            y, sid = y.to(device, non_blocking=True), sid.to(device, non_blocking=True)

            with autocast(enabled=hps.train.fp16_run):
                y_hat, l_length, attn, ids_slice, x_mask, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q) = \
                    net_g(x, x_len, spec, spec_len, sid=sid)
                mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                                        hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)
                y_mel = commons.slice_segments(mel, ids_slice, seg)
                y_hat_mel = mel_spectrogram_torch(y_hat.squeeze(1), hps.data.filter_length,
                                                  hps.data.n_mel_channels, hps.data.sampling_rate,
                                                  hps.data.hop_length, hps.data.win_length,
                                                  hps.data.mel_fmin, hps.data.mel_fmax)
                y = commons.slice_segments(y, ids_slice * hps.data.hop_length, hps.train.segment_size)
                y_d_r, y_d_g, _, _ = net_d(y, y_hat.detach())
                with autocast(enabled=False):
                    loss_disc, _, _ = discriminator_loss(y_d_r, y_d_g)
            optim_d.zero_grad()
            scaler.scale(loss_disc).backward()
            scaler.unscale_(optim_d)
            grad_norm_d = commons.clip_grad_value_(net_d.parameters(), None)
            scaler.step(optim_d)

            with autocast(enabled=hps.train.fp16_run):
                y_d_r, y_d_g, fmap_r, fmap_g = net_d(y, y_hat)
                with autocast(enabled=False):
                    # SDP returns a per-utterance NLL, summed like the deterministic one
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

            if rank == 0:
                if global_step % hps.train.log_interval == 0:
                    lr = optim_g.param_groups[0]["lr"]
                    logger.info(f"epoch {epoch} [{100.0 * batch_idx / len(train_loader):.0f}%] step {global_step} "
                                f"d {loss_disc.item():.3f} g {loss_gen.item():.3f} fm {loss_fm.item():.3f} "
                                f"mel {loss_mel.item():.3f} dur {loss_dur.item():.3f} kl {loss_kl.item():.3f}")
                    utils.summarize(writer=writer, global_step=global_step, scalars={
                        "loss/d/total": loss_disc, "loss/g/total": loss_gen_all, "loss/g/fm": loss_fm,
                        "loss/g/mel": loss_mel, "loss/g/dur": loss_dur, "loss/g/kl": loss_kl,
                        "learning_rate": lr, "grad_norm_d": grad_norm_d, "grad_norm_g": grad_norm_g})
                if global_step % hps.train.eval_interval == 0:
                    evaluate(hps, net_g.module, eval_loader, writer_eval, global_step, device)
                    save_ckpt(os.path.join(hps.model_dir, f"G_{global_step}.pth"), net_g.module, optim_g,
                              global_step, epoch)
                    save_ckpt(os.path.join(hps.model_dir, f"D_{global_step}.pth"), net_d.module, optim_d,
                              global_step, epoch)
            global_step += 1

        sched_g.step()
        sched_d.step()
        if rank == 0:
            logger.info(f"====> epoch {epoch}")

    dist.destroy_process_group()


@torch.no_grad()
def evaluate(hps, generator, eval_loader, writer_eval, step, device, max_utts=8):
    """Rank 0 only, on the unwrapped generator."""
    generator.eval()
    audios, images = {}, {}
    for i, (x, x_len, spec, spec_len, y, y_len, sid) in enumerate(eval_loader):
        if i >= max_utts:
            break
        x, x_len, sid = x.to(device), x_len.to(device), sid.to(device)
        y_hat, attn, mask, *_ = generator.infer(x, x_len, sid=sid, noise_scale=0.667,
                                                noise_scale_w=0.8, length_scale=1.0, max_len=1000)
        y_hat_len = int(mask.sum().item()) * hps.data.hop_length
        y_hat_mel = mel_spectrogram_torch(y_hat.squeeze(1).float(), hps.data.filter_length,
                                          hps.data.n_mel_channels, hps.data.sampling_rate,
                                          hps.data.hop_length, hps.data.win_length,
                                          hps.data.mel_fmin, hps.data.mel_fmax)
        images[f"gen/mel_{i}"] = utils.plot_spectrogram_to_numpy(y_hat_mel[0].cpu().numpy())
        audios[f"gen/audio_{i}"] = y_hat[0, :, :y_hat_len]
        if step == 0:
            audios[f"gt/audio_{i}"] = y[0, :, :y_len[0]]
    utils.summarize(writer=writer_eval, global_step=step, images=images, audios=audios,
                    audio_sampling_rate=hps.data.sampling_rate)
    generator.train()


if __name__ == "__main__":
    main()
