"""UniVNet-c32 vocoder training (LVC generator, MPD + MRD), with a UTMOS proxy on the dev set.

    torchrun --standalone --nproc_per_node=8 12_univnet_c32.py -c config/c32.yaml -n univnet_c32 --ckpt_dir exp
"""
import argparse
import os
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from datasets.dataloader import MelFromDisk, collate_pad
from model.discriminator import Discriminator
from model.generator import Generator
from utils.stft import TacotronSTFT
from utils.stft_loss import MultiResolutionSTFTLoss


def strip_module_prefix(state_dict):
    # older runs were saved from the DDP wrapper
    return OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in state_dict.items())


@torch.no_grad()
def dev_utmos(generator, dev_items, stft, utmos, hp, device, rank, world):
    """Score dev utterances on all ranks; returns the mean over unique utterances (same value on all ranks)."""
    generator.eval()
    resample = torchaudio.transforms.Resample(hp.audio.sampling_rate, 16000).to(device)
    local = []
    for utt_id, wav_path in dev_items[rank::world]:
        wav, sr = torchaudio.load(wav_path)
        assert sr == hp.audio.sampling_rate
        mel = stft.mel_spectrogram(wav.to(device))
        noise = torch.randn(1, hp.gen.noise_dim, mel.size(2), device=device)
        audio = generator(mel, noise).squeeze(1).clamp(-1.0, 1.0)
        local.append((utt_id, float(utmos(resample(audio), 16000).item())))
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    scores = {utt: s for part in gathered for utt, s in part}
    generator.train()
    return sum(scores.values()) / max(len(scores), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-n", "--name", required=True)
    ap.add_argument("--ckpt_dir", default="exp")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    hp = OmegaConf.load(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(hp.train.seed)
    out_dir = os.path.join(args.ckpt_dir, args.name)

    trainset = MelFromDisk(hp, hp.data.train_dir, hp.data.train_meta, train=True)
    sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    loader = DataLoader(trainset, batch_size=hp.train.batch_size, sampler=sampler, num_workers=hp.train.num_workers,
                        pin_memory=True, drop_last=True, collate_fn=collate_pad)
    with open(hp.data.dev_meta) as f:
        dev_items = [tuple(l.strip().split("|")[:2]) for l in f if l.strip()][: hp.log.num_dev_utts]

    gen = Generator(hp).to(device)
    disc = Discriminator(hp).to(device)
    opt_g = torch.optim.AdamW(gen.parameters(), lr=hp.train.adam.lr, betas=(hp.train.adam.beta1, hp.train.adam.beta2))
    opt_d = torch.optim.AdamW(disc.parameters(), lr=hp.train.adam.lr, betas=(hp.train.adam.beta1, hp.train.adam.beta2))

    step, epoch0 = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        gen.load_state_dict(strip_module_prefix(ck["model_g"]))
        disc.load_state_dict(strip_module_prefix(ck["model_d"]))
        opt_g.load_state_dict(ck["optim_g"])
        opt_d.load_state_dict(ck["optim_d"])
        step, epoch0 = ck["step"], ck["epoch"] + 1

    gen = DDP(gen, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])
    stft = TacotronSTFT(hp.audio.filter_length, hp.audio.hop_length, hp.audio.win_length, hp.audio.n_mel_channels,
                        hp.audio.sampling_rate, hp.audio.mel_fmin, hp.audio.mel_fmax, center=False, device=device)
    stft_criterion = MultiResolutionSTFTLoss(device, hp.mrd.resolutions)

    if rank == 0:
        utmos = torch.hub.load("tarepan/SpeechMOS:v1.2.0", "utmos22_strong", trust_repo=True)
    dist.barrier()
    if rank != 0:
        utmos = torch.hub.load("tarepan/SpeechMOS:v1.2.0", "utmos22_strong", trust_repo=True)
    utmos = utmos.to(device).eval()

    writer = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(out_dir, "logs"))

    max_wav = hp.train.max_segment_samples
    for epoch in range(epoch0, hp.train.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for mel, audio in loader:
            # a rare overly long padded batch would OOM the MRD; all ranks skip it together
            too_long = torch.tensor([int(audio.size(-1) > max_wav)], device=device)
            dist.all_reduce(too_long, op=dist.ReduceOp.MAX)
            if too_long.item():
                continue

            mel = mel.to(device, non_blocking=True)
            audio = audio.to(device, non_blocking=True)
            noise = torch.randn(mel.size(0), hp.gen.noise_dim, mel.size(2), device=device)

            fake_audio = gen(mel, noise)[..., : audio.size(-1)]
            sc_loss, mag_loss = stft_criterion(fake_audio.squeeze(1), audio.squeeze(1))
            loss_g = hp.train.stft_lamb * (sc_loss + mag_loss)
            res_fake, period_fake = disc(fake_audio)
            for (_, score_fake) in res_fake + period_fake:
                loss_g = loss_g + torch.mean(torch.pow(score_fake - 1.0, 2)) / len(res_fake + period_fake)
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()

            res_fake, period_fake = disc(fake_audio.detach())
            res_real, period_real = disc(audio)
            loss_d = 0.0
            for (_, sf), (_, sr_) in zip(res_fake + period_fake, res_real + period_real):
                loss_d = loss_d + torch.mean(torch.pow(sr_ - 1.0, 2)) + torch.mean(torch.pow(sf, 2))
            loss_d = loss_d / len(res_fake + period_fake)
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()
            step += 1

            if step % hp.log.summary_interval == 0:
                vals = torch.stack([loss_g.detach(), loss_d.detach(), sc_loss.detach(), mag_loss.detach()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    for k, v in zip(["g", "d", "sc", "mag"], vals.tolist()):
                        writer.add_scalar(f"train/{k}", v, step)

            if step % hp.log.validation_interval == 0:
                mos = dev_utmos(gen.module, dev_items, stft, utmos, hp, device, rank, world)
                if rank == 0:
                    writer.add_scalar("dev/utmos", mos, step)
                    print(f"step {step}: dev UTMOS {mos:.3f}", flush=True)

            if step % hp.log.save_interval == 0:
                if rank == 0:
                    torch.save({"model_g": gen.module.state_dict(), "model_d": disc.module.state_dict(),
                                "optim_g": opt_g.state_dict(), "optim_d": opt_d.state_dict(),
                                "step": step, "epoch": epoch, "hp_str": OmegaConf.to_yaml(hp)},
                               os.path.join(out_dir, f"{args.name}_{step:07d}.pt"))
                dist.barrier()

        if rank == 0:
            print(f"epoch {epoch} finished in {time.time() - t0:.0f}s", flush=True)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
