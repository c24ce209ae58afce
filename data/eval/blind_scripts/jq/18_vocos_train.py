"""Vocos (ConvNeXt backbone + ISTFT head) trained without Lightning.

Validation: every rank vocodes its slice of the validation set; UTMOS (MOS proxy) and mel L1
decide which generator is kept as best.pt.

    torchrun --nproc_per_node=4 18_vocos_train.py --train_list lists/libritts_train.txt \
        --val_list lists/libritts_dev.txt --out runs/vocos_mel
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from vocos.discriminators import MultiPeriodDiscriminator, MultiResolutionDiscriminator
from vocos.feature_extractors import MelSpectrogramFeatures
from vocos.heads import ISTFTHead
from vocos.loss import DiscriminatorLoss, FeatureMatchingLoss, GeneratorLoss, MelSpecReconstructionLoss
from vocos.models import VocosBackbone

SR = 24000


class AudioList(Dataset):
    def __init__(self, list_path, num_samples=None, train=True):
        with open(list_path) as f:
            self.paths = [l.strip() for l in f if l.strip()]
        self.num_samples, self.train = num_samples, train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        y, sr = torchaudio.load(self.paths[i])
        y = y.mean(0, keepdim=True)
        if sr != SR:
            y = torchaudio.functional.resample(y, sr, SR)
        gain = random.uniform(-1, -6) if self.train else -3
        y, _ = torchaudio.sox_effects.apply_effects_tensor(y, SR, [["norm", f"{gain:.2f}"]])
        if self.num_samples is not None:
            if y.size(-1) < self.num_samples:
                y = torch.nn.functional.pad(y, (0, self.num_samples - y.size(-1)))
            elif self.train:
                start = random.randint(0, y.size(-1) - self.num_samples)
                y = y[:, start:start + self.num_samples]
            else:
                y = y[:, :self.num_samples]
        return y[0]


class Vocos(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.feature_extractor = MelSpectrogramFeatures(sample_rate=SR, n_fft=1024, hop_length=256, n_mels=100)
        self.backbone = VocosBackbone(input_channels=100, dim=512, intermediate_dim=1536, num_layers=8)
        self.head = ISTFTHead(dim=512, n_fft=1024, hop_length=256, padding="same")

    def forward(self, audio):
        return self.head(self.backbone(self.feature_extractor(audio)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_list", required=True)
    ap.add_argument("--val_list", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--num_samples", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--max_steps", type=int, default=1_000_000)
    ap.add_argument("--val_every", type=int, default=5000)
    ap.add_argument("--mel_coeff", type=float, default=45.0)
    ap.add_argument("--mrd_coeff", type=float, default=0.1)
    ap.add_argument("--pretrain_mel_steps", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set = AudioList(args.train_list, args.num_samples, train=True)
    val_set = AudioList(args.val_list, 48384, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=16, sampler=val_sampler, num_workers=4)

    vocos = DDP(Vocos().to(device), device_ids=[local_rank])
    mpd = DDP(MultiPeriodDiscriminator().to(device), device_ids=[local_rank])
    mrd = DDP(MultiResolutionDiscriminator().to(device), device_ids=[local_rank])
    opt_d = torch.optim.AdamW(list(mpd.parameters()) + list(mrd.parameters()), lr=args.lr, betas=(0.8, 0.9))
    opt_g = torch.optim.AdamW(vocos.parameters(), lr=args.lr, betas=(0.8, 0.9))
    sched_d = torch.optim.lr_scheduler.CosineAnnealingLR(opt_d, T_max=args.max_steps)
    sched_g = torch.optim.lr_scheduler.CosineAnnealingLR(opt_g, T_max=args.max_steps)

    disc_loss, gen_loss, fm_loss = DiscriminatorLoss(), GeneratorLoss(), FeatureMatchingLoss()
    mel_loss = MelSpecReconstructionLoss(sample_rate=SR).to(device)
    utmos = torch.hub.load("tarepan/SpeechMOS:v1.2.0", "utmos22_strong", trust_repo=True) if rank == 0 else None
    dist.barrier()
    if utmos is None:
        utmos = torch.hub.load("tarepan/SpeechMOS:v1.2.0", "utmos22_strong", trust_repo=True)
    utmos = utmos.to(device).eval()
    resample_16k = torchaudio.transforms.Resample(SR, 16000).to(device)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)

    step, epoch, best_mos = 0, 0, -1.0
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for audio in train_loader:
            audio = audio.to(device, non_blocking=True)
            audio_hat = vocos(audio)
            train_disc = step >= args.pretrain_mel_steps

            if train_disc:
                real_p, gen_p, _, _ = mpd(y=audio, y_hat=audio_hat.detach())
                real_r, gen_r, _, _ = mrd(y=audio, y_hat=audio_hat.detach())
                loss_mp, _, _ = disc_loss(disc_real_outputs=real_p, disc_generated_outputs=gen_p)
                loss_mrd, _, _ = disc_loss(disc_real_outputs=real_r, disc_generated_outputs=gen_r)
                loss_d = loss_mp / len(real_p) + args.mrd_coeff * loss_mrd / len(real_r)
                opt_d.zero_grad(set_to_none=True)
                loss_d.backward()
                opt_d.step()

            loss_mel = mel_loss(audio_hat, audio)
            loss_g = args.mel_coeff * loss_mel
            if train_disc:
                _, gen_p, fmap_rs_p, fmap_gs_p = mpd(y=audio, y_hat=audio_hat)
                _, gen_r, fmap_rs_r, fmap_gs_r = mrd(y=audio, y_hat=audio_hat)
                loss_gen_mp, _ = gen_loss(disc_outputs=gen_p)
                loss_gen_mrd, _ = gen_loss(disc_outputs=gen_r)
                loss_fm_mp = fm_loss(fmap_r=fmap_rs_p, fmap_g=fmap_gs_p) / len(fmap_rs_p)
                loss_fm_mrd = fm_loss(fmap_r=fmap_rs_r, fmap_g=fmap_gs_r) / len(fmap_rs_r)
                loss_g = (loss_g + loss_gen_mp / len(gen_p) + args.mrd_coeff * loss_gen_mrd / len(gen_r)
                          + loss_fm_mp + args.mrd_coeff * loss_fm_mrd)
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            sched_d.step()
            sched_g.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/mel_loss", loss_mel.item(), step)
                writer.add_scalar("train/total_g", loss_g.item(), step)
                if train_disc:
                    writer.add_scalar("train/total_d", loss_d.item(), step)

            if step % args.val_every == 0:
                vocos.eval()
                mel_errs, mos_scores = [], []
                with torch.no_grad():
                    for audio_v in val_loader:
                        audio_v = audio_v.to(device)
                        audio_v_hat = vocos.module(audio_v)
                        mel_errs.append(mel_loss(audio_v_hat, audio_v).item())
                        mos_scores.extend(utmos(resample_16k(audio_v_hat), 16000).tolist())
                vocos.train()
                if rank == 0:
                    val_mel = float(np.mean(mel_errs))
                    val_mos = float(np.mean(mos_scores))
                    writer.add_scalar("val/mel_loss", val_mel, step)
                    writer.add_scalar("val/utmos", val_mos, step)
                    print(f"step {step}: val mel {val_mel:.4f} utmos {val_mos:.3f}", flush=True)
                    state = {"vocos": vocos.module.state_dict(), "mpd": mpd.module.state_dict(),
                             "mrd": mrd.module.state_dict(), "opt_g": opt_g.state_dict(),
                             "opt_d": opt_d.state_dict(), "step": step}
                    torch.save(state, os.path.join(args.out, "last.pt"))
                    if val_mos > best_mos:
                        best_mos = val_mos
                        torch.save({"vocos": state["vocos"], "step": step, "utmos": val_mos},
                                   os.path.join(args.out, "best.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
