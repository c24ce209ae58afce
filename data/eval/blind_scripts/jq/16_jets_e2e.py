"""JETS: jointly trained FastSpeech2 + HiFi-GAN with an unsupervised alignment module.

    torchrun --nproc_per_node=4 16_jets_e2e.py --config conf/jets_ljspeech.yaml --out exp/jets
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from jets.data import JetsCollate, JetsDataset, LengthBucketDistributedSampler
from jets.discriminator import HiFiGANMultiScaleMultiPeriodDiscriminator
from jets.generator import JETSGenerator
from jets.losses import (DiscriminatorAdversarialLoss, FeatureMatchLoss, ForwardSumLoss,
                         GeneratorAdversarialLoss, MelSpectrogramLoss, VarianceLoss)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


def main():
    args = get_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    dataset = JetsDataset(cfg["data"]["train_list"], cfg["data"])
    sampler = LengthBucketDistributedSampler(dataset.lengths, cfg["train"]["batch_size"],
                                             num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=JetsCollate(), num_workers=8, pin_memory=True)

    gen = JETSGenerator(**cfg["generator"]).to(device)
    disc = HiFiGANMultiScaleMultiPeriodDiscriminator(**cfg["discriminator"]).to(device)
    opt_g = torch.optim.AdamW(gen.parameters(), lr=cfg["train"]["lr"], betas=(0.8, 0.99), eps=1e-9,
                              weight_decay=0.0)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=cfg["train"]["lr"], betas=(0.8, 0.99), eps=1e-9,
                              weight_decay=0.0)
    sch_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, gamma=0.999875)
    sch_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, gamma=0.999875)

    step, epoch0 = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        gen.load_state_dict(ck["generator"])
        disc.load_state_dict(ck["discriminator"])
        opt_g.load_state_dict(ck["opt_g"])
        opt_d.load_state_dict(ck["opt_d"])
        sch_g.load_state_dict(ck["sch_g"])
        sch_d.load_state_dict(ck["sch_d"])
        step, epoch0 = ck["step"], ck["epoch"] + 1

    gen = DDP(gen, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])

    mel_loss = MelSpectrogramLoss(**cfg["mel_loss"]).to(device)
    adv_g_loss = GeneratorAdversarialLoss()
    adv_d_loss = DiscriminatorAdversarialLoss()
    fm_loss = FeatureMatchLoss()
    var_loss = VarianceLoss()
    align_loss = ForwardSumLoss()
    lam = cfg["loss_weights"]
    max_wav = cfg["train"]["max_wav_samples"]

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)

    for epoch in range(epoch0, cfg["train"]["epochs"]):
        sampler.set_epoch(epoch)
        gen.train()
        disc.train()
        t0, n_skipped = time.time(), 0
        for batch in loader:
            text, text_len, feats, feats_len, wav, pitch, energy = [b.to(device, non_blocking=True) for b in batch]
            # a handful of very long utterances do not fit with the full-length alignment module
            if wav.size(-1) > max_wav:
                n_skipped += 1
                continue

            (wav_hat, start_idxs, d_outs, ds, p_outs, ps, e_outs, es, log_p_attn, bin_loss) = gen(
                text, text_len, feats, feats_len, wav, pitch, energy)
            seg = cfg["generator"]["segment_size"] * cfg["generator"]["upsample_factor"]
            wav_seg = torch.stack([wav[i, :, s * cfg["generator"]["upsample_factor"]:
                                             s * cfg["generator"]["upsample_factor"] + seg]
                                   for i, s in enumerate(start_idxs.tolist())])

            # discriminator
            p_real = disc(wav_seg)
            p_fake = disc(wav_hat.detach())
            loss_d_real, loss_d_fake = adv_d_loss(p_fake, p_real)
            loss_d = loss_d_real + loss_d_fake
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            torch.nn.utils.clip_grad_norm_(disc.parameters(), cfg["train"]["grad_clip"])
            opt_d.step()

            # generator
            p_fake = disc(wav_hat)
            with torch.no_grad():
                p_real = disc(wav_seg)
            loss_mel = mel_loss(wav_hat, wav_seg)
            loss_adv = adv_g_loss(p_fake)
            loss_fm = fm_loss(p_fake, p_real)
            loss_dur, loss_pitch, loss_energy = var_loss(d_outs, ds, p_outs, ps, e_outs, es, text_len)
            loss_align = align_loss(log_p_attn, text_len, feats_len) + bin_loss
            loss_g = (lam["mel"] * loss_mel + lam["adv"] * loss_adv + lam["fm"] * loss_fm
                      + lam["var"] * (loss_dur + loss_pitch + loss_energy) + lam["align"] * loss_align)
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(gen.parameters(), cfg["train"]["grad_clip"])
            if math.isfinite(gnorm.item()):
                opt_g.step()
            sch_g.step()
            sch_d.step()
            step += 1

            if rank == 0 and step % cfg["train"]["log_every"] == 0:
                for k, v in dict(d=loss_d, g=loss_g, mel=loss_mel, adv=loss_adv, fm=loss_fm, dur=loss_dur,
                                 pitch=loss_pitch, energy=loss_energy, align=loss_align).items():
                    writer.add_scalar(f"train/{k}", v.item(), step)
                writer.add_scalar("train/grad_norm_g", gnorm.item(), step)

            if rank == 0 and step % cfg["train"]["save_every"] == 0:
                torch.save({"generator": gen.module.state_dict(), "discriminator": disc.module.state_dict(),
                            "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(),
                            "sch_g": sch_g.state_dict(), "sch_d": sch_d.state_dict(),
                            "step": step, "epoch": epoch},
                           os.path.join(args.out, f"jets_{step:08d}.pth"))
                gen.module.eval()
                with torch.no_grad():
                    wav_inf, *_ = gen.module.inference(text[0, : text_len[0]])
                gen.module.train()
                writer.add_audio("infer/sample", wav_inf.view(1, -1).cpu(), step, cfg["data"]["sampling_rate"])

        if rank == 0:
            print(f"epoch {epoch}: {time.time() - t0:.0f}s, skipped {n_skipped} long batches", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
