"""BigVGAN-style vocoder (snake activations, MPD + MRD), 24 kHz LibriTTS.

Periodic objective eval: PESQ (wb) and a UTMOS MOS proxy on a held-out set, computed on every rank
for its share of the utterances and then combined.

    torchrun --nproc_per_node=8 07_bigvgan_lite.py --config configs/bigvgan_24khz_100band.yaml
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
import yaml
from pesq import pesq
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from bigvgan import BigVGAN
from discriminators import MultiPeriodDiscriminator, MultiResolutionDiscriminator
from losses import discriminator_loss, feature_loss, generator_loss
from meldataset import MelDataset, get_mel, load_wav

UTMOS_SR = 16000


def load_utmos(device):
    predictor = torch.hub.load("tarepan/SpeechMOS:v1.2.0", "utmos22_strong", trust_repo=True)
    return predictor.to(device).eval()


@torch.no_grad()
def objective_eval(generator, val_files, cfg, device, utmos, rank, world_size):
    """Each rank scores files[rank::world_size]; returns global means on every rank."""
    generator.eval()
    pesq_sum, mos_sum, n = 0.0, 0.0, 0
    resample_16k = torchaudio.transforms.Resample(cfg["sampling_rate"], UTMOS_SR).to(device)
    for path in val_files[rank::world_size]:
        wav = load_wav(path, cfg["sampling_rate"]).to(device)
        mel = get_mel(wav.unsqueeze(0), cfg)
        wav_hat = generator(mel).squeeze(1)[:, : wav.numel()]
        ref16 = resample_16k(wav.unsqueeze(0)).squeeze(0).cpu().numpy()
        hat16 = resample_16k(wav_hat).squeeze(0).clamp(-1, 1)
        try:
            pesq_sum += pesq(UTMOS_SR, ref16, hat16.cpu().numpy(), "wb")
        except Exception:
            continue  # pesq raises on silent / too-short utterances
        mos_sum += utmos(hat16.unsqueeze(0), UTMOS_SR).item()
        n += 1
    stats = torch.tensor([pesq_sum, mos_sum, float(n)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    generator.train()
    total = max(stats[2].item(), 1.0)
    return stats[0].item() / total, stats[1].item() / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--exp_dir", default="exp/bigvgan_lite")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_set = MelDataset(cfg["train_list"], cfg, split=True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                        num_workers=cfg["num_workers"], pin_memory=True, drop_last=True,
                        persistent_workers=True)
    with open(cfg["val_list"]) as f:
        val_files = [l.strip().split("|")[0] for l in f if l.strip()]

    gen = BigVGAN(cfg).to(device)
    mpd = MultiPeriodDiscriminator(cfg).to(device)
    mrd = MultiResolutionDiscriminator(cfg).to(device)
    opt_g = torch.optim.AdamW(gen.parameters(), cfg["lr"], betas=(cfg["adam_b1"], cfg["adam_b2"]))
    opt_d = torch.optim.AdamW(list(mpd.parameters()) + list(mrd.parameters()), cfg["lr"],
                              betas=(cfg["adam_b1"], cfg["adam_b2"]))

    step, epoch0 = 0, 0
    ckpt_path = os.path.join(args.exp_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        gen.load_state_dict(ck["gen"])
        mpd.load_state_dict(ck["mpd"])
        mrd.load_state_dict(ck["mrd"])
        opt_g.load_state_dict(ck["opt_g"])
        opt_d.load_state_dict(ck["opt_d"])
        step, epoch0 = ck["step"], ck["epoch"] + 1

    gen = DDP(gen, device_ids=[local_rank])
    mpd = DDP(mpd, device_ids=[local_rank])
    mrd = DDP(mrd, device_ids=[local_rank])
    sch_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, cfg["lr_decay"], last_epoch=epoch0 - 1)
    sch_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, cfg["lr_decay"], last_epoch=epoch0 - 1)

    # rank 0 fills the torch.hub cache first, the others then read it
    if rank == 0:
        utmos = load_utmos(device)
    dist.barrier()
    if rank != 0:
        utmos = load_utmos(device)
    writer = SummaryWriter(os.path.join(args.exp_dir, "tb")) if rank == 0 else None
    best_mos = -1.0

    for epoch in range(epoch0, cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for mel, wav, _, mel_loss_target in loader:
            mel = mel.to(device, non_blocking=True)
            wav = wav.to(device, non_blocking=True).unsqueeze(1)
            mel_loss_target = mel_loss_target.to(device, non_blocking=True)

            wav_hat = gen(mel)
            mel_hat = get_mel(wav_hat.squeeze(1), cfg, for_loss=True)

            opt_d.zero_grad(set_to_none=True)
            r_f, g_f, _, _ = mpd(wav, wav_hat.detach())
            r_s, g_s, _, _ = mrd(wav, wav_hat.detach())
            loss_d = discriminator_loss(r_f, g_f)[0] + discriminator_loss(r_s, g_s)[0]
            loss_d.backward()
            grad_d = torch.nn.utils.clip_grad_norm_(list(mpd.parameters()) + list(mrd.parameters()), 1000.0)
            opt_d.step()

            opt_g.zero_grad(set_to_none=True)
            loss_mel = F.l1_loss(mel_hat, mel_loss_target) * 45.0
            r_f, g_f, fm_rf, fm_gf = mpd(wav, wav_hat)
            r_s, g_s, fm_rs, fm_gs = mrd(wav, wav_hat)
            loss_fm = feature_loss(fm_rf, fm_gf) + feature_loss(fm_rs, fm_gs)
            loss_adv = generator_loss(g_f)[0] + generator_loss(g_s)[0]
            loss_g = loss_adv + loss_fm + loss_mel
            loss_g.backward()
            grad_g = torch.nn.utils.clip_grad_norm_(gen.parameters(), 1000.0)
            opt_g.step()

            if rank == 0 and step % cfg["log_every"] == 0:
                writer.add_scalar("train/loss_d", loss_d.item(), step)
                writer.add_scalar("train/loss_g", loss_g.item(), step)
                writer.add_scalar("train/mel_l1", loss_mel.item() / 45.0, step)
                writer.add_scalar("train/grad_norm_g", grad_g.item(), step)
                writer.add_scalar("train/grad_norm_d", grad_d.item(), step)

            if step % cfg["eval_every"] == 0 and step > 0:
                val_pesq, val_mos = objective_eval(gen.module, val_files, cfg, device, utmos, rank, world_size)
                if rank == 0:
                    writer.add_scalar("val/pesq_wb", val_pesq, step)
                    writer.add_scalar("val/utmos", val_mos, step)
                    print(f"step {step}: PESQ {val_pesq:.3f}  UTMOS {val_mos:.3f}", flush=True)
                    state = {"gen": gen.module.state_dict(), "mpd": mpd.module.state_dict(),
                             "mrd": mrd.module.state_dict(), "opt_g": opt_g.state_dict(),
                             "opt_d": opt_d.state_dict(), "step": step, "epoch": epoch}
                    os.makedirs(args.exp_dir, exist_ok=True)
                    torch.save(state, ckpt_path)
                    if val_mos > best_mos:
                        best_mos = val_mos
                        torch.save({"gen": state["gen"], "step": step, "utmos": val_mos},
                                   os.path.join(args.exp_dir, "best_utmos.pt"))
                dist.barrier()
            step += 1

        sch_g.step()
        sch_d.step()
        if rank == 0:
            print(f"epoch {epoch} took {time.time() - t0:.0f}s", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
