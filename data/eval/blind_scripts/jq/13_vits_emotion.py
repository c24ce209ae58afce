"""Emotional VITS: speaker + emotion embeddings (ESD corpus), emotion-conditioned duration predictor.

    python 13_vits_emotion.py -c configs/esd_emo.json -m esd_emo
"""
import os
import json
import argparse
import logging
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from torch.cuda.amp import autocast, GradScaler

import commons
from data_utils import TextAudioEmotionLoader, TextAudioEmotionCollate, DistributedBucketSampler
from models import SynthesizerTrnEmo, MultiPeriodDiscriminator
from losses import generator_loss, discriminator_loss, feature_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from text.symbols import symbols
from utils import plot_spectrogram_to_numpy, latest_checkpoint_path

torch.backends.cudnn.benchmark = True


def to_ns(d):
    return SimpleNamespace(**{k: to_ns(v) if isinstance(v, dict) else v for k, v in d.items()})


def get_logger(model_dir):
    logger = logging.getLogger("vits_emo")
    logger.setLevel(logging.INFO)
    fh = logging.FileHandler(os.path.join(model_dir, "train.log"))
    fh.setFormatter(logging.Formatter("%(asctime)s\t%(levelname)s\t%(message)s"))
    logger.addHandler(fh)
    logger.addHandler(logging.StreamHandler())
    return logger


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("-m", "--model", required=True)
    args = parser.parse_args()

    with open(args.config) as f:
        config = json.load(f)
    model_dir = os.path.join("./logs", args.model)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    hps = to_ns(config)
    hps.model_dir = model_dir
    hps.n_gpus = torch.cuda.device_count()
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(hps.train.port)
    mp.spawn(run, nprocs=hps.n_gpus, args=(hps))


def run(rank, hps):
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl", init_method="env://", world_size=hps.n_gpus, rank=rank)
    torch.manual_seed(hps.train.seed)

    logger = writer = writer_eval = None
    if rank == 0:
        logger = get_logger(hps.model_dir)
        writer = SummaryWriter(log_dir=hps.model_dir)
        writer_eval = SummaryWriter(log_dir=os.path.join(hps.model_dir, "eval"))

    train_dataset = TextAudioEmotionLoader(hps.data.training_files, hps.data)
    train_sampler = DistributedBucketSampler(train_dataset, hps.train.batch_size,
                                             [32, 300, 400, 500, 600, 700, 800, 900, 1000],
                                             num_replicas=hps.n_gpus, rank=rank, shuffle=True)
    collate_fn = TextAudioEmotionCollate()
    train_loader = DataLoader(train_dataset, num_workers=8, shuffle=False, pin_memory=True,
                              collate_fn=collate_fn, batch_sampler=train_sampler)
    if rank == 0:
        eval_dataset = TextAudioEmotionLoader(hps.data.validation_files, hps.data)
        eval_loader = DataLoader(eval_dataset, num_workers=2, shuffle=False, batch_size=1,
                                 collate_fn=collate_fn)

    net_g = SynthesizerTrnEmo(len(symbols), hps.data.filter_length // 2 + 1,
                              hps.train.segment_size // hps.data.hop_length,
                              n_speakers=hps.data.n_speakers, n_emotions=hps.data.n_emotions,
                              **vars(hps.model)).cuda(rank)
    net_d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).cuda(rank)
    optim_g = torch.optim.AdamW(net_g.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)
    optim_d = torch.optim.AdamW(net_d.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)

    epoch_str, global_step = 1, 0
    try:
        ckpt_g = torch.load(latest_checkpoint_path(hps.model_dir, "G_*.pth"), map_location="cpu")
        ckpt_d = torch.load(latest_checkpoint_path(hps.model_dir, "D_*.pth"), map_location="cpu")
        net_g.load_state_dict(ckpt_g["model"])
        net_d.load_state_dict(ckpt_d["model"])
        optim_g.load_state_dict(ckpt_g["optimizer"])
        optim_d.load_state_dict(ckpt_d["optimizer"])
        epoch_str, global_step = ckpt_g["epoch"] + 1, ckpt_g["step"]
    except (IndexError, FileNotFoundError):
        pass

    net_g = DDP(net_g, device_ids=[rank])
    net_d = DDP(net_d, device_ids=[rank])
    scheduler_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=hps.train.lr_decay, last_epoch=epoch_str - 2)
    scheduler_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=hps.train.lr_decay, last_epoch=epoch_str - 2)
    scaler = GradScaler(enabled=hps.train.fp16_run)
    seg = hps.train.segment_size // hps.data.hop_length

    def mel_of(wav):
        return mel_spectrogram_torch(wav.squeeze(1).float(), hps.data.filter_length, hps.data.n_mel_channels,
                                     hps.data.sampling_rate, hps.data.hop_length, hps.data.win_length,
                                     hps.data.mel_fmin, hps.data.mel_fmax)

    for epoch in range(epoch_str, hps.train.epochs + 1):
        train_sampler.set_epoch(epoch)
        net_g.train()
        net_d.train()
        for x, x_len, spec, spec_len, y, y_len, sid, eid in train_loader:
            x, x_len = x.cuda(rank, non_blocking=True), x_len.cuda(rank, non_blocking=True)
            spec, spec_len = spec.cuda(rank, non_blocking=True), spec_len.cuda(rank, non_blocking=True)
            y = y.cuda(rank, non_blocking=True)
            sid, eid = sid.cuda(rank, non_blocking=True), eid.cuda(rank, non_blocking=True)

            with autocast(enabled=hps.train.fp16_run):
                y_hat, l_length, attn, ids_slice, x_mask, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q) = \
                    net_g(x, x_len, spec, spec_len, sid=sid, eid=eid)
                mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                                        hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)
                y_mel = commons.slice_segments(mel, ids_slice, seg)
                y_hat_mel = mel_of(y_hat)
                y = commons.slice_segments(y, ids_slice * hps.data.hop_length, hps.train.segment_size)
                y_d_hat_r, y_d_hat_g, _, _ = net_d(y, y_hat.detach())
                with autocast(enabled=False):
                    loss_disc, _, _ = discriminator_loss(y_d_hat_r, y_d_hat_g)
            optim_d.zero_grad()
            scaler.scale(loss_disc).backward()
            scaler.unscale_(optim_d)
            commons.clip_grad_value_(net_d.parameters(), None)
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
            commons.clip_grad_value_(net_g.parameters(), None)
            scaler.step(optim_g)
            scaler.update()

            if rank == 0:
                if global_step % hps.train.log_interval == 0:
                    logger.info(f"epoch {epoch} step {global_step}: d={loss_disc.item():.3f} g={loss_gen.item():.3f} "
                                f"fm={loss_fm.item():.3f} mel={loss_mel.item():.3f} dur={loss_dur.item():.3f} "
                                f"kl={loss_kl.item():.3f}")
                    for k, v in [("d", loss_disc), ("g", loss_gen), ("fm", loss_fm), ("mel", loss_mel),
                                 ("dur", loss_dur), ("kl", loss_kl)]:
                        writer.add_scalar(f"loss/{k}", v.item(), global_step)
                if global_step % hps.train.eval_interval == 0:
                    evaluate(net_g.module, eval_loader, writer_eval, global_step, rank, hps, mel_of)
                    for name, net, opt in [("G", net_g, optim_g), ("D", net_d, optim_d)]:
                        torch.save({"model": net.module.state_dict(), "optimizer": opt.state_dict(),
                                    "epoch": epoch, "step": global_step},
                                   os.path.join(hps.model_dir, f"{name}_{global_step}.pth"))
            global_step += 1

        scheduler_g.step()
        scheduler_d.step()

    dist.destroy_process_group()


@torch.no_grad()
def evaluate(generator, eval_loader, writer, step, rank, hps, mel_of, n=4):
    generator.eval()
    for i, (x, x_len, spec, spec_len, y, y_len, sid, eid) in enumerate(eval_loader):
        if i == n:
            break
        x, x_len, sid, eid = x.cuda(rank), x_len.cuda(rank), sid.cuda(rank), eid.cuda(rank)
        y_hat, _, mask, *_ = generator.infer(x, x_len, sid=sid, eid=eid, max_len=1000)
        length = int(mask.sum().item()) * hps.data.hop_length
        writer.add_audio(f"gen/{i}", y_hat[0, :, :length].cpu(), step, hps.data.sampling_rate)
        writer.add_image(f"gen/mel_{i}", plot_spectrogram_to_numpy(mel_of(y_hat)[0].cpu().numpy()), step,
                         dataformats="HWC")
    generator.train()


if __name__ == "__main__":
    main()
