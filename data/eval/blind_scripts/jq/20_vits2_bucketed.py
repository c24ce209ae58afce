"""VITS2-style training: transformer flow, noise-scaled MAS and an adversarial duration discriminator.

    torchrun --standalone --nproc_per_node=8 20_vits2_bucketed.py -c configs/vits2_ljs.json -m vits2_ljs
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.cuda.amp import GradScaler, autocast
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

import commons
import utils
from data_utils import DistributedBucketSampler, TextAudioCollate, TextAudioLoader
from losses import discriminator_loss, feature_loss, generator_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from models import DurationDiscriminator, MultiPeriodDiscriminator, SynthesizerTrn
from text.symbols import symbols


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-m", "--model", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    hps = utils.HParams(**config)
    hps.model_dir = os.path.join("logs", args.model)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(hps.train.seed)

    writer = writer_eval = logger = None
    if rank == 0:
        os.makedirs(hps.model_dir, exist_ok=True)
        with open(os.path.join(hps.model_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        logger = utils.get_logger(hps.model_dir)
        writer = SummaryWriter(hps.model_dir)
        writer_eval = SummaryWriter(os.path.join(hps.model_dir, "eval"))
    dist.barrier()

    train_set = TextAudioLoader(hps.data.training_files, hps.data)
    sampler = DistributedBucketSampler(train_set, hps.train.batch_size,
                                       [32, 300, 400, 500, 600, 700, 800, 900, 1000],
                                       num_replicas=world, rank=rank, shuffle=True)
    collate = TextAudioCollate()
    train_loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=collate, num_workers=8,
                              pin_memory=True, persistent_workers=True)
    eval_loader = None
    if rank == 0:
        eval_loader = DataLoader(TextAudioLoader(hps.data.validation_files, hps.data), batch_size=1,
                                 shuffle=False, collate_fn=collate, num_workers=2)

    net_g = SynthesizerTrn(len(symbols), hps.data.filter_length // 2 + 1,
                           hps.train.segment_size // hps.data.hop_length,
                           mas_noise_scale_initial=0.01, noise_scale_delta=2e-6, **hps.model).to(device)
    net_d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).to(device)
    net_dur_disc = DurationDiscriminator(hps.model.hidden_channels, hps.model.hidden_channels, 3, 0.1).to(device)
    lr, betas, eps = hps.train.learning_rate, hps.train.betas, hps.train.eps
    optim_g = torch.optim.AdamW(net_g.parameters(), lr, betas=betas, eps=eps)
    optim_d = torch.optim.AdamW(net_d.parameters(), lr, betas=betas, eps=eps)
    optim_dur = torch.optim.AdamW(net_dur_disc.parameters(), lr, betas=betas, eps=eps)

    epoch_str, step = 1, 0
    ckpt_path = os.path.join(hps.model_dir, "last.pth")
    if os.path.exists(ckpt_path):
        # saved from rank 0; remap its cuda:0 tensors onto this rank's GPU
        ck = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        for net, opt, key in [(net_g, optim_g, "g"), (net_d, optim_d, "d"), (net_dur_disc, optim_dur, "dur")]:
            net.load_state_dict(ck[f"net_{key}"])
            opt.load_state_dict(ck[f"optim_{key}"])
        net_g.current_mas_noise_scale = ck["mas_noise_scale"]
        epoch_str, step = ck["epoch"] + 1, ck["step"]

    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])
    net_dur_disc = DDP(net_dur_disc, device_ids=[local_rank])
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, hps.train.lr_decay, last_epoch=epoch_str - 2)
              for o in (optim_g, optim_d, optim_dur)]
    scaler = GradScaler(enabled=hps.train.fp16_run)
    seg = hps.train.segment_size // hps.data.hop_length

    def mel_of(wav):
        return mel_spectrogram_torch(wav.squeeze(1).float(), hps.data.filter_length, hps.data.n_mel_channels,
                                     hps.data.sampling_rate, hps.data.hop_length, hps.data.win_length,
                                     hps.data.mel_fmin, hps.data.mel_fmax)

    for epoch in range(epoch_str, hps.train.epochs + 1):
        sampler.set_epoch(epoch)
        for m in (net_g, net_d, net_dur_disc):
            m.train()
        for x, x_len, spec, spec_len, y, y_len in train_loader:
            # the annealed MAS noise lives on the inner module; same value on every rank
            net_g.module.current_mas_noise_scale = max(
                net_g.module.mas_noise_scale_initial - net_g.module.noise_scale_delta * step, 0.0)
            x, x_len = x.to(device, non_blocking=True), x_len.to(device, non_blocking=True)
            spec, spec_len = spec.to(device, non_blocking=True), spec_len.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)

            with autocast(enabled=hps.train.fp16_run):
                (y_hat, l_length, attn, ids_slice, x_mask, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q),
                 (hidden_x, logw, logw_)) = net_g(x, x_len, spec, spec_len)
                mel = spec_to_mel_torch(spec, hps.data.filter_length, hps.data.n_mel_channels,
                                        hps.data.sampling_rate, hps.data.mel_fmin, hps.data.mel_fmax)
                y_mel = commons.slice_segments(mel, ids_slice, seg)
                y_hat_mel = mel_of(y_hat)
                y = commons.slice_segments(y, ids_slice * hps.data.hop_length, hps.train.segment_size)

                y_d_r, y_d_g, _, _ = net_d(y, y_hat.detach())
                with autocast(enabled=False):
                    loss_disc, _, _ = discriminator_loss(y_d_r, y_d_g)
            optim_d.zero_grad()
            scaler.scale(loss_disc).backward()
            scaler.unscale_(optim_d)
            commons.clip_grad_value_(net_d.parameters(), None)
            scaler.step(optim_d)

            with autocast(enabled=hps.train.fp16_run):
                y_dur_r, y_dur_g = net_dur_disc(hidden_x.detach(), x_mask.detach(), logw_.detach(), logw.detach())
                with autocast(enabled=False):
                    loss_dur_disc, _, _ = discriminator_loss(y_dur_r, y_dur_g)
            optim_dur.zero_grad()
            scaler.scale(loss_dur_disc).backward()
            scaler.unscale_(optim_dur)
            commons.clip_grad_value_(net_dur_disc.parameters(), None)
            scaler.step(optim_dur)

            with autocast(enabled=hps.train.fp16_run):
                y_d_r, y_d_g, fmap_r, fmap_g = net_d(y, y_hat)
                _, y_dur_g = net_dur_disc(hidden_x, x_mask, logw_, logw)
                with autocast(enabled=False):
                    loss_dur = torch.sum(l_length.float())
                    loss_mel = F.l1_loss(y_mel, y_hat_mel) * hps.train.c_mel
                    loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * hps.train.c_kl
                    loss_fm = feature_loss(fmap_r, fmap_g)
                    loss_gen, _ = generator_loss(y_d_g)
                    loss_dur_gen, _ = generator_loss(y_dur_g)
                    loss_gen_all = loss_gen + loss_fm + loss_mel + loss_dur + loss_kl + loss_dur_gen
            optim_g.zero_grad()
            scaler.scale(loss_gen_all).backward()
            scaler.unscale_(optim_g)
            commons.clip_grad_value_(net_g.parameters(), None)
            scaler.step(optim_g)
            scaler.update()

            if step % hps.train.log_interval == 0:
                stats = torch.stack([loss_disc, loss_dur_disc, loss_gen, loss_fm, loss_mel, loss_dur,
                                     loss_kl]).detach().float()
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    names = ["d", "dur_d", "g", "fm", "mel", "dur", "kl"]
                    logger.info(f"epoch {epoch} step {step} " + " ".join(
                        f"{n}={v:.3f}" for n, v in zip(names, stats.tolist())))
                    for n, v in zip(names, stats.tolist()):
                        writer.add_scalar(f"loss/{n}", v, step)
                    writer.add_scalar("mas_noise_scale", net_g.module.current_mas_noise_scale, step)

            if step % hps.train.eval_interval == 0:
                if rank == 0:
                    evaluate(net_g.module, eval_loader, writer_eval, step, device, hps, mel_of)
                    torch.save({"net_g": net_g.module.state_dict(), "net_d": net_d.module.state_dict(),
                                "net_dur": net_dur_disc.module.state_dict(), "optim_g": optim_g.state_dict(),
                                "optim_d": optim_d.state_dict(), "optim_dur": optim_dur.state_dict(),
                                "mas_noise_scale": net_g.module.current_mas_noise_scale,
                                "epoch": epoch, "step": step}, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()
            step += 1

        for s in scheds:
            s.step()

    dist.destroy_process_group()


@torch.no_grad()
def evaluate(generator, loader, writer, step, device, hps, mel_of, n_utts=4):
    generator.eval()
    for i, (x, x_len, spec, spec_len, y, y_len) in enumerate(loader):
        if i >= n_utts:
            break
        y_hat, _, mask, *_ = generator.infer(x.to(device), x_len.to(device), noise_scale=0.667,
                                             length_scale=1.0, noise_scale_w=0.8, max_len=1000)
        n = int(mask.sum().item()) * hps.data.hop_length
        writer.add_audio(f"gen/audio_{i}", y_hat[0, :, :n].cpu(), step, hps.data.sampling_rate)
        writer.add_image(f"gen/mel_{i}", utils.plot_spectrogram_to_numpy(mel_of(y_hat)[0].cpu().numpy()),
                         step, dataformats="HWC")
    generator.train()


if __name__ == "__main__":
    main()
