"""FreeVC-style any-to-many voice conversion: WavLM content features -> VITS decoder, speaker table.

Launch:  torchrun --nproc_per_node=4 06_freevc_train.py -c configs/freevc_vctk.json -m freevc_vctk
"""
import argparse
import glob
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import commons
import utils
from losses import discriminator_loss, feature_loss, generator_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spectrogram_torch
from models import MultiPeriodDiscriminator, SynthesizerTrn


class VCDataset(Dataset):
    """Items are (wav_path, speaker). WavLM features are precomputed next to each wav as *.ssl.pt."""

    def __init__(self, items, spk2id, hps, max_frames=None):
        self.items = items
        self.spk2id = spk2id
        self.hps = hps
        self.max_frames = max_frames

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        wav_path, spk = self.items[idx]
        audio, sr = utils.load_wav_to_torch(wav_path)
        assert sr == self.hps.data.sampling_rate
        audio = (audio / self.hps.data.max_wav_value).unsqueeze(0)
        spec = spectrogram_torch(audio, self.hps.data.filter_length, self.hps.data.sampling_rate,
                                 self.hps.data.hop_length, self.hps.data.win_length, center=False).squeeze(0)
        c = torch.load(wav_path.replace(".wav", ".ssl.pt"), map_location="cpu").squeeze(0)
        T = min(c.size(-1), spec.size(-1))
        c, spec, audio = c[:, :T], spec[:, :T], audio[:, :T * self.hps.data.hop_length]
        if self.max_frames is not None and T > self.max_frames:
            start = random.randint(0, T - self.max_frames)
            c = c[:, start:start + self.max_frames]
            spec = spec[:, start:start + self.max_frames]
            hop = self.hps.data.hop_length
            audio = audio[:, start * hop:(start + self.max_frames) * hop]
        return c, spec, audio, torch.LongTensor([self.spk2id[spk]])


def collate(batch):
    batch = sorted(batch, key=lambda b: b[1].size(1), reverse=True)
    max_t = batch[0][1].size(1)
    B = len(batch)
    c_pad = torch.zeros(B, batch[0][0].size(0), max_t)
    spec_pad = torch.zeros(B, batch[0][1].size(0), max_t)
    wav_pad = torch.zeros(B, 1, max(b[2].size(1) for b in batch))
    spec_lengths = torch.LongTensor(B)
    wav_lengths = torch.LongTensor(B)
    sid = torch.LongTensor(B)
    for i, (c, spec, wav, s) in enumerate(batch):
        c_pad[i, :, :c.size(1)] = c
        spec_pad[i, :, :spec.size(1)] = spec
        wav_pad[i, :, :wav.size(1)] = wav
        spec_lengths[i] = spec.size(1)
        wav_lengths[i] = wav.size(1)
        sid[i] = s
    return c_pad, spec_pad, wav_pad, spec_lengths, wav_lengths, sid


def build_splits(root, n_val_per_spk):
    speakers = sorted(os.listdir(root))
    spk2id = {s: i for i, s in enumerate(speakers)}
    train_items, val_items = [], []
    for spk in speakers:
        wavs = sorted(glob.glob(os.path.join(root, spk, "*.wav")))
        random.shuffle(wavs)
        val_items += [(w, spk) for w in wavs[:n_val_per_spk]]
        train_items += [(w, spk) for w in wavs[n_val_per_spk:]]
    return train_items, val_items, spk2id


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-m", "--model", required=True)
    args = ap.parse_args()
    hps = utils.get_hparams_from_file(args.config)
    model_dir = os.path.join("logs", args.model)

    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(hps.train.seed)

    train_items, val_items, spk2id = build_splits(hps.data.root, hps.data.n_val_per_speaker)
    train_set = VCDataset(train_items, spk2id, hps, max_frames=hps.train.max_frames)
    val_set = VCDataset(val_items, spk2id, hps)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=hps.train.batch_size, sampler=sampler, num_workers=8,
                              collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)

    writer = None
    if rank == 0:
        os.makedirs(model_dir, exist_ok=True)
        writer = SummaryWriter(model_dir)
        print(f"{len(spk2id)} speakers, {len(train_items)} train / {len(val_items)} val utterances")

    net_g = SynthesizerTrn(hps.data.filter_length // 2 + 1, hps.train.segment_size // hps.data.hop_length,
                           n_speakers=len(spk2id), **hps.model).to(device)
    net_d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).to(device)
    optim_g = torch.optim.AdamW(net_g.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)
    optim_d = torch.optim.AdamW(net_d.parameters(), hps.train.learning_rate, betas=hps.train.betas, eps=hps.train.eps)

    epoch_start, step = 1, 0
    ckpts = sorted(glob.glob(os.path.join(model_dir, "G_*.pth")), key=lambda p: int(p.split("_")[-1][:-4]))
    if ckpts:
        _, _, _, epoch_start = utils.load_checkpoint(ckpts[-1], net_g, optim_g)
        _, _, _, epoch_start = utils.load_checkpoint(ckpts[-1].replace("G_", "D_"), net_d, optim_d)
        step = int(ckpts[-1].split("_")[-1][:-4])

    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, hps.train.lr_decay, last_epoch=epoch_start - 2)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, hps.train.lr_decay, last_epoch=epoch_start - 2)
    scaler = GradScaler(enabled=hps.train.fp16_run)
    hop, seg = hps.data.hop_length, hps.train.segment_size

    for epoch in range(epoch_start, hps.train.epochs + 1):
        sampler.set_epoch(epoch)
        net_g.train(); net_d.train()
        for c, spec, y, spec_lengths, y_lengths, sid in train_loader:
            c, spec, y = c.to(device), spec.to(device), y.to(device)
            spec_lengths, sid = spec_lengths.to(device), sid.to(device)
            mel = mel_spectrogram_torch(y.squeeze(1), hps.data.filter_length, hps.data.n_mel_channels,
                                        hps.data.sampling_rate, hop, hps.data.win_length,
                                        hps.data.mel_fmin, hps.data.mel_fmax)

            with autocast(enabled=hps.train.fp16_run):
                y_hat, ids_slice, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q) = \
                    net_g(c, spec, sid=sid, c_lengths=spec_lengths, spec_lengths=spec_lengths)
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
                    loss_mel = F.l1_loss(y_mel, y_hat_mel) * hps.train.c_mel
                    loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * hps.train.c_kl
                    loss_fm = feature_loss(fmap_r, fmap_g)
                    loss_gen, _ = generator_loss(y_d_g)
                    loss_g = loss_gen + loss_fm + loss_mel + loss_kl
            optim_g.zero_grad()
            scaler.scale(loss_g).backward()
            scaler.unscale_(optim_g)
            commons.clip_grad_value_(net_g.parameters(), None)
            scaler.step(optim_g)
            scaler.update()

            if rank == 0 and step % hps.train.log_interval == 0:
                writer.add_scalar("loss/g/total", loss_g.item(), step)
                writer.add_scalar("loss/g/mel", loss_mel.item(), step)
                writer.add_scalar("loss/g/kl", loss_kl.item(), step)
                writer.add_scalar("loss/d/total", loss_disc.item(), step)

            if rank == 0 and step % hps.train.eval_interval == 0:
                net_g.module.eval()
                with torch.no_grad():
                    vc, vspec, vy, vlen, _, vsid = collate([val_set[i] for i in range(4)])
                    tgt = torch.randint(0, len(spk2id), (vc.size(0),), device=device)
                    out = net_g.module.infer(vc.to(device), sid=tgt, c_lengths=vlen.to(device))
                    for i in range(out.size(0)):
                        writer.add_audio(f"vc/{i}_to_{tgt[i].item()}", out[i].float().cpu(), step,
                                         hps.data.sampling_rate)
                net_g.module.train()
                utils.save_checkpoint(net_g.module, optim_g, hps.train.learning_rate, epoch,
                                      os.path.join(model_dir, f"G_{step}.pth"))
                utils.save_checkpoint(net_d.module, optim_d, hps.train.learning_rate, epoch,
                                      os.path.join(model_dir, f"D_{step}.pth"))
            step += 1

        sched_g.step()
        sched_d.step()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
