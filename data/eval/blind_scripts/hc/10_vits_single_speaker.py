"""Single-speaker VITS fine-tuning / training, torchrun + DDP.

    torchrun --nproc_per_node=4 10_vits_single_speaker.py --config configs/ljs_base.json --out runs/vits_ljs
"""
import argparse
import bisect
import logging
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.tensorboard import SummaryWriter

import commons
import utils
from data_utils import TextAudioCollate, TextAudioLoader
from losses import discriminator_loss, feature_loss, generator_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from models import MultiPeriodDiscriminator, SynthesizerTrn
from text.symbols import symbols

log = logging.getLogger("vits")


class BucketBatchSampler(Sampler):
    """Length buckets -> fixed-size batches, each rank takes an equal slice of every bucket."""

    def __init__(self, lengths, batch_size, boundaries, num_replicas, rank, seed=1234):
        self.batch_size, self.num_replicas, self.rank, self.seed = batch_size, num_replicas, rank, seed
        self.epoch = 0
        self.buckets = [[] for _ in range(len(boundaries) - 1)]
        for i, l in enumerate(lengths):
            b = bisect.bisect_left(boundaries, l) - 1
            if 0 <= b < len(self.buckets):
                self.buckets[b].append(i)
        self.buckets = [b for b in self.buckets if b]
        step = batch_size * num_replicas
        self.padded = [int(math.ceil(len(b) / step)) * step for b in self.buckets]

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        batches = []
        for bucket, n in zip(self.buckets, self.padded):
            order = [bucket[i] for i in torch.randperm(len(bucket), generator=g).tolist()]
            order = (order * (n // len(order) + 1))[:n]
            mine = order[self.rank::self.num_replicas]
            batches += [mine[j:j + self.batch_size] for j in range(0, len(mine), self.batch_size)]
        perm = torch.randperm(len(batches), generator=g).tolist()
        return iter([batches[i] for i in perm])

    def __len__(self):
        return sum(n // (self.batch_size * self.num_replicas) for n in self.padded)


class Trainer:
    def __init__(self, hps, out_dir, rank, local_rank, world_size):
        self.hps, self.out_dir = hps, out_dir
        self.rank, self.device = rank, torch.device("cuda", local_rank)
        self.step, self.epoch = 0, 1

        ds = TextAudioLoader(hps.data.training_files, hps.data)
        self.sampler = BucketBatchSampler(ds.lengths, hps.train.batch_size,
                                          [32, 300, 400, 500, 600, 700, 800, 900, 1000],
                                          num_replicas=world_size, rank=rank, seed=hps.train.seed)
        self.loader = DataLoader(ds, batch_sampler=self.sampler, collate_fn=TextAudioCollate(),
                                 num_workers=8, pin_memory=True, persistent_workers=True)
        if rank == 0:
            val = TextAudioLoader(hps.data.validation_files, hps.data)
            self.val_loader = DataLoader(val, batch_size=1, shuffle=False, collate_fn=TextAudioCollate())
            self.writer = SummaryWriter(out_dir)

        g = SynthesizerTrn(len(symbols), hps.data.filter_length // 2 + 1,
                           hps.train.segment_size // hps.data.hop_length, **hps.model).to(self.device)
        d = MultiPeriodDiscriminator(hps.model.use_spectral_norm).to(self.device)
        self.optim_g = torch.optim.AdamW(g.parameters(), hps.train.learning_rate, betas=hps.train.betas,
                                         eps=hps.train.eps)
        self.optim_d = torch.optim.AdamW(d.parameters(), hps.train.learning_rate, betas=hps.train.betas,
                                         eps=hps.train.eps)
        self._maybe_resume(g, d)
        self.net_g = DDP(g, device_ids=[local_rank])
        self.net_d = DDP(d, device_ids=[local_rank])
        self.sched_g = torch.optim.lr_scheduler.ExponentialLR(self.optim_g, hps.train.lr_decay,
                                                              last_epoch=self.epoch - 2)
        self.sched_d = torch.optim.lr_scheduler.ExponentialLR(self.optim_d, hps.train.lr_decay,
                                                              last_epoch=self.epoch - 2)
        self.scaler = GradScaler(enabled=hps.train.fp16_run)

    def _maybe_resume(self, g, d):
        path = os.path.join(self.out_dir, "last.pt")
        if not os.path.exists(path):
            return
        ckpt = torch.load(path, map_location="cpu")
        g.load_state_dict(ckpt["net_g"])
        d.load_state_dict(ckpt["net_d"])
        self.optim_g.load_state_dict(ckpt["optim_g"])
        self.optim_d.load_state_dict(ckpt["optim_d"])
        self.step, self.epoch = ckpt["step"], ckpt["epoch"] + 1
        for group in self.optim_g.param_groups + self.optim_d.param_groups:
            group.setdefault("initial_lr", self.hps.train.learning_rate)

    def save(self):
        state = {"net_g": self.net_g.module.state_dict(), "net_d": self.net_d.module.state_dict(),
                 "optim_g": self.optim_g.state_dict(), "optim_d": self.optim_d.state_dict(),
                 "step": self.step, "epoch": self.epoch}
        torch.save(state, os.path.join(self.out_dir, "last.pt.tmp"))
        os.replace(os.path.join(self.out_dir, "last.pt.tmp"), os.path.join(self.out_dir, "last.pt"))

    def mel(self, spec=None, wav=None):
        h = self.hps.data
        if spec is not None:
            return spec_to_mel_torch(spec, h.filter_length, h.n_mel_channels, h.sampling_rate, h.mel_fmin, h.mel_fmax)
        return mel_spectrogram_torch(wav, h.filter_length, h.n_mel_channels, h.sampling_rate, h.hop_length,
                                     h.win_length, h.mel_fmin, h.mel_fmax)

    def train_epoch(self):
        hps, dev = self.hps, self.device
        seg, hop = hps.train.segment_size, hps.data.hop_length
        self.net_g.train()
        self.net_d.train()
        for x, x_len, spec, spec_len, y, y_len in self.loader:
            x, x_len, spec, spec_len, y = (t.to(dev, non_blocking=True) for t in (x, x_len, spec, spec_len, y))
            with autocast(enabled=hps.train.fp16_run):
                y_hat, l_length, _, ids_slice, _, z_mask, (z, z_p, m_p, logs_p, m_q, logs_q) = \
                    self.net_g(x, x_len, spec, spec_len)
                y_mel = commons.slice_segments(self.mel(spec=spec), ids_slice, seg // hop)
                y_hat_mel = self.mel(wav=y_hat.squeeze(1))
                y = commons.slice_segments(y, ids_slice * hop, seg)
                d_r, d_g, _, _ = self.net_d(y, y_hat.detach())
                with autocast(enabled=False):
                    loss_d, _, _ = discriminator_loss(d_r, d_g)
            self.optim_d.zero_grad()
            self.scaler.scale(loss_d).backward()
            self.scaler.unscale_(self.optim_d)
            commons.clip_grad_value_(self.net_d.parameters(), None)
            self.scaler.step(self.optim_d)

            with autocast(enabled=hps.train.fp16_run):
                d_r, d_g, fmap_r, fmap_g = self.net_d(y, y_hat)
                with autocast(enabled=False):
                    loss_dur = l_length.float().sum()
                    loss_mel = F.l1_loss(y_mel, y_hat_mel) * hps.train.c_mel
                    loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * hps.train.c_kl
                    loss_fm = feature_loss(fmap_r, fmap_g)
                    loss_adv, _ = generator_loss(d_g)
                    loss_g = loss_adv + loss_fm + loss_mel + loss_dur + loss_kl
            self.optim_g.zero_grad()
            self.scaler.scale(loss_g).backward()
            self.scaler.unscale_(self.optim_g)
            commons.clip_grad_value_(self.net_g.parameters(), None)
            self.scaler.step(self.optim_g)
            self.scaler.update()

            if self.rank == 0 and self.step % hps.train.log_interval == 0:
                for k, v in (("g/total", loss_g), ("g/mel", loss_mel), ("g/kl", loss_kl), ("g/dur", loss_dur),
                             ("g/fm", loss_fm), ("d/total", loss_d)):
                    self.writer.add_scalar("loss/" + k, v.item(), self.step)
            if self.rank == 0 and self.step % hps.train.eval_interval == 0:
                self.validate()
                self.save()
            self.step += 1

        self.sched_g.step()
        self.sched_d.step()

    @torch.no_grad()
    def validate(self):
        g = self.net_g.module
        g.eval()
        for i, (x, x_len, spec, spec_len, y, y_len) in enumerate(self.val_loader):
            if i == 3:
                break
            y_hat, _, mask, *_ = g.infer(x.to(self.device), x_len.to(self.device), max_len=1000)
            n = int(mask.sum()) * self.hps.data.hop_length
            self.writer.add_audio(f"val/gen_{i}", y_hat[0, :, :n].float().cpu(), self.step,
                                  self.hps.data.sampling_rate)
            if self.step == 0:
                self.writer.add_audio(f"val/gt_{i}", y[0, :, :y_len[0]], self.step, self.hps.data.sampling_rate)
        g.train()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hps = utils.get_hparams_from_file(args.config)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(hps.train.seed)
    random.seed(hps.train.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logging.basicConfig(level=logging.INFO)
    dist.barrier()

    trainer = Trainer(hps, args.out, rank, local_rank, world)
    while trainer.epoch <= hps.train.epochs:
        trainer.train_epoch()
        if rank == 0:
            log.info("epoch %d done, step %d", trainer.epoch, trainer.step)
        trainer.epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
