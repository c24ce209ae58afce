"""Glow-TTS style flow acoustic model with monotonic alignment search.

The duration predictor is trained on MAS durations; it is kept out of the loss for the first
`dp_start_step` updates, while the alignments are still poor.

    torchrun --nproc_per_node=4 09_glowtts_mas.py --config configs/glowtts_ljs.json --out logs/glowtts
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import monotonic_align
from data_utils import TextMelCollate, TextMelLoader
from modules import FlowSpecDecoder, TextEncoder
from text.symbols import symbols
from utils import HParams, plot_alignment_to_numpy, plot_spectrogram_to_numpy


def sequence_mask(length, max_length=None):
    if max_length is None:
        max_length = length.max()
    x = torch.arange(max_length, dtype=length.dtype, device=length.device)
    return x.unsqueeze(0) < length.unsqueeze(1)


class DurationPredictor(nn.Module):
    def __init__(self, in_ch, filter_ch, kernel_size, p_dropout):
        super().__init__()
        self.drop = nn.Dropout(p_dropout)
        self.conv_1 = nn.Conv1d(in_ch, filter_ch, kernel_size, padding=kernel_size // 2)
        self.norm_1 = nn.GroupNorm(1, filter_ch)
        self.conv_2 = nn.Conv1d(filter_ch, filter_ch, kernel_size, padding=kernel_size // 2)
        self.norm_2 = nn.GroupNorm(1, filter_ch)
        self.proj = nn.Conv1d(filter_ch, 1, 1)

    def forward(self, x, x_mask):
        x = self.drop(self.norm_1(torch.relu(self.conv_1(x * x_mask))))
        x = self.drop(self.norm_2(torch.relu(self.conv_2(x * x_mask))))
        return self.proj(x * x_mask) * x_mask


class GlowTTS(nn.Module):
    def __init__(self, n_vocab, hp):
        super().__init__()
        self.encoder = TextEncoder(n_vocab, hp.out_channels, hp.hidden_channels, hp.filter_channels,
                                   hp.n_heads, hp.n_layers_enc, hp.kernel_size, hp.p_dropout)
        self.proj_w = DurationPredictor(hp.hidden_channels, hp.filter_channels_dp, 3, hp.p_dropout)
        self.decoder = FlowSpecDecoder(hp.out_channels, hp.hidden_channels_dec, hp.kernel_size_dec,
                                       hp.dilation_rate, hp.n_blocks_dec, hp.n_block_layers, hp.n_split,
                                       hp.n_sqz)
        self.n_sqz = hp.n_sqz

    def forward(self, x, x_lengths, y, y_lengths, train_dp=True):
        x_m, x_logs, x_h, x_mask = self.encoder(x, x_lengths)
        y_max = (y.size(2) // self.n_sqz) * self.n_sqz
        y, y_lengths = y[:, :, :y_max], (y_lengths // self.n_sqz) * self.n_sqz
        z_mask = sequence_mask(y_lengths, y_max).unsqueeze(1).to(x_mask.dtype)
        attn_mask = x_mask.unsqueeze(-1) * z_mask.unsqueeze(2)

        z, logdet = self.decoder(y, z_mask)
        with torch.no_grad():
            x_s_sq_r = torch.exp(-2 * x_logs)
            logp1 = torch.sum(-0.5 * math.log(2 * math.pi) - x_logs, [1]).unsqueeze(-1)
            logp2 = torch.matmul(x_s_sq_r.transpose(1, 2), -0.5 * (z ** 2))
            logp3 = torch.matmul((x_m * x_s_sq_r).transpose(1, 2), z)
            logp4 = torch.sum(-0.5 * (x_m ** 2) * x_s_sq_r, [1]).unsqueeze(-1)
            logp = logp1 + logp2 + logp3 + logp4
            attn = monotonic_align.maximum_path(logp, attn_mask.squeeze(1)).unsqueeze(1).detach()

        z_m = torch.matmul(attn.squeeze(1).transpose(1, 2), x_m.transpose(1, 2)).transpose(1, 2)
        z_logs = torch.matmul(attn.squeeze(1).transpose(1, 2), x_logs.transpose(1, 2)).transpose(1, 2)
        logw_ = torch.log(1e-8 + torch.sum(attn, -1)) * x_mask
        logw = self.proj_w(x_h.detach(), x_mask) if train_dp else None
        return (z, z_m, z_logs, logdet, z_mask), (x_m, x_logs, x_mask), (attn, logw, logw_)


def mle_loss(z, m, logs, logdet, mask):
    l = torch.sum(logs) + 0.5 * torch.sum(torch.exp(-2 * logs) * ((z - m) ** 2))
    l = l - torch.sum(logdet)
    l = l / torch.sum(torch.ones_like(z) * mask)
    return l + 0.5 * math.log(2 * math.pi)


def duration_loss(logw, logw_, x_mask):
    return torch.sum((logw - logw_) ** 2) / torch.sum(x_mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        hps = HParams(**json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(hps.train.seed)

    train_set = TextMelLoader(hps.data.training_files, hps.data)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    collate = TextMelCollate(1)
    loader = DataLoader(train_set, batch_size=hps.train.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=8, pin_memory=True, drop_last=True)
    val_loader = None
    if rank == 0:
        val_set = TextMelLoader(hps.data.validation_files, hps.data)
        val_loader = DataLoader(val_set, batch_size=hps.train.batch_size, shuffle=False,
                                collate_fn=collate, num_workers=2)

    model = GlowTTS(len(symbols), hps.model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=hps.train.learning_rate, betas=hps.train.betas,
                                 eps=hps.train.eps)
    model = DDP(model, device_ids=[local_rank])
    warmup = hps.train.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, (warmup / (s + 1)) ** 0.5))
    writer = SummaryWriter(args.out) if rank == 0 else None

    global_step = 0
    for epoch in range(1, hps.train.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        for x, x_lengths, y, y_lengths in loader:
            x, x_lengths = x.to(device, non_blocking=True), x_lengths.to(device, non_blocking=True)
            y, y_lengths = y.to(device, non_blocking=True), y_lengths.to(device, non_blocking=True)

            train_dp = global_step >= hps.train.dp_start_step
            (z, z_m, z_logs, logdet, z_mask), (_, _, x_mask), (attn, logw, logw_) = model(
                x, x_lengths, y, y_lengths, train_dp=train_dp)
            l_mle = mle_loss(z, z_m, z_logs, logdet, z_mask)
            loss = l_mle
            l_dur = torch.zeros((), device=device)
            if train_dp:
                l_dur = duration_loss(logw, logw_, x_mask)
                loss = loss + l_dur

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()

            if rank == 0 and global_step % hps.train.log_interval == 0:
                writer.add_scalar("loss/mle", l_mle.item(), global_step)
                writer.add_scalar("loss/dur", l_dur.item(), global_step)
                writer.add_scalar("grad_norm", grad_norm.item(), global_step)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], global_step)
                writer.add_image("align", plot_alignment_to_numpy(attn[0, 0].cpu().numpy()),
                                 global_step, dataformats="HWC")
            global_step += 1

        if rank == 0:
            validate(model.module, val_loader, writer, epoch, global_step, device, hps)
            if epoch % hps.train.save_every == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": global_step, "epoch": epoch},
                           os.path.join(args.out, f"G_{global_step}.pth"))
        dist.barrier()

    dist.destroy_process_group()


@torch.no_grad()
def validate(model, loader, writer, epoch, step, device, hps):
    model.eval()
    tot, n = 0.0, 0
    for x, x_lengths, y, y_lengths in loader:
        x, x_lengths = x.to(device), x_lengths.to(device)
        y, y_lengths = y.to(device), y_lengths.to(device)
        (z, z_m, z_logs, logdet, z_mask), _, _ = model(x, x_lengths, y, y_lengths, train_dp=False)
        tot += mle_loss(z, z_m, z_logs, logdet, z_mask).item() * x.size(0)
        n += x.size(0)
    writer.add_scalar("val/mle", tot / max(n, 1), step)
    print(f"epoch {epoch} step {step} val mle {tot / max(n, 1):.4f}", flush=True)
    model.train()


if __name__ == "__main__":
    main()
