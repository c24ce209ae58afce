#!/usr/bin/env python
"""FastSpeech2 acoustic model (duration / pitch / energy predictors + Tacotron2 postnet).

torchrun --nproc_per_node=4 03_fastspeech2_variance.py --config conf/fs2_ljs.yaml
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from dataset import FS2Dataset, fs2_collate  # phoneme ids, mel, duration, pitch, energy (precomputed by MFA + preprocess.py)
from transformer import FFTBlockStack


def get_mask_from_lengths(lengths, max_len=None):
    max_len = max_len or int(lengths.max().item())
    ids = torch.arange(max_len, device=lengths.device).unsqueeze(0)
    return ids >= lengths.unsqueeze(1)  # True on padding


class VariancePredictor(nn.Module):
    def __init__(self, d_model, filter_size=256, kernel=3, dropout=0.5):
        super().__init__()
        self.conv1 = nn.Conv1d(d_model, filter_size, kernel, padding=kernel // 2)
        self.ln1 = nn.LayerNorm(filter_size)
        self.conv2 = nn.Conv1d(filter_size, filter_size, kernel, padding=kernel // 2)
        self.ln2 = nn.LayerNorm(filter_size)
        self.proj = nn.Linear(filter_size, 1)
        self.dropout = dropout

    def forward(self, x, mask):
        x = F.relu(self.conv1(x.transpose(1, 2))).transpose(1, 2)
        x = F.dropout(self.ln1(x), self.dropout, self.training)
        x = F.relu(self.conv2(x.transpose(1, 2))).transpose(1, 2)
        x = F.dropout(self.ln2(x), self.dropout, self.training)
        return self.proj(x).squeeze(-1).masked_fill(mask, 0.0)


class LengthRegulator(nn.Module):
    def forward(self, x, durations, max_len=None):
        out = [torch.repeat_interleave(xi, di, dim=0) for xi, di in zip(x, durations)]
        mel_lens = torch.tensor([o.size(0) for o in out], device=x.device)
        max_len = max_len or int(mel_lens.max())
        out = torch.stack([F.pad(o, (0, 0, 0, max_len - o.size(0))) for o in out])
        return out, mel_lens


class PostNet(nn.Module):
    def __init__(self, n_mels=80, channels=512, kernel=5, n_layers=5):
        super().__init__()
        layers = []
        for i in range(n_layers):
            c_in = n_mels if i == 0 else channels
            c_out = n_mels if i == n_layers - 1 else channels
            layers.append(nn.Sequential(nn.Conv1d(c_in, c_out, kernel, padding=kernel // 2), nn.BatchNorm1d(c_out)))
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        x = x.transpose(1, 2)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
            x = F.dropout(x, 0.5, self.training)
        return x.transpose(1, 2)


class FastSpeech2(nn.Module):
    def __init__(self, cfg, n_symbols, n_speakers, pitch_stats, energy_stats):
        super().__init__()
        d = cfg["d_model"]
        self.embed = nn.Embedding(n_symbols, d, padding_idx=0)
        self.spk = nn.Embedding(n_speakers, d)
        self.encoder = FFTBlockStack(d, cfg["n_heads"], cfg["enc_layers"], cfg["ff_kernel"])
        self.decoder = FFTBlockStack(d, cfg["n_heads"], cfg["dec_layers"], cfg["ff_kernel"])
        self.duration_predictor = VariancePredictor(d)
        self.pitch_predictor = VariancePredictor(d)
        self.energy_predictor = VariancePredictor(d)
        self.register_buffer("pitch_bins", torch.linspace(pitch_stats[0], pitch_stats[1], cfg["n_bins"] - 1))
        self.register_buffer("energy_bins", torch.linspace(energy_stats[0], energy_stats[1], cfg["n_bins"] - 1))
        self.pitch_embed = nn.Embedding(cfg["n_bins"], d)
        self.energy_embed = nn.Embedding(cfg["n_bins"], d)
        self.length_regulator = LengthRegulator()
        self.mel_linear = nn.Linear(d, cfg["n_mels"])
        self.postnet = PostNet(cfg["n_mels"])

    def forward(self, phones, src_lens, speakers, durations, pitch, energy, mel_max_len):
        src_mask = get_mask_from_lengths(src_lens, phones.size(1))
        x = self.encoder(self.embed(phones), src_mask)
        x = x + self.spk(speakers).unsqueeze(1)

        log_d_pred = self.duration_predictor(x, src_mask)
        p_pred = self.pitch_predictor(x, src_mask)
        e_pred = self.energy_predictor(x, src_mask)
        # teacher forcing on the variance embeddings (phoneme-level pitch/energy)
        x = x + self.pitch_embed(torch.bucketize(pitch, self.pitch_bins))
        x = x + self.energy_embed(torch.bucketize(energy, self.energy_bins))

        x, mel_lens = self.length_regulator(x, durations, mel_max_len)
        mel_mask = get_mask_from_lengths(mel_lens, mel_max_len)
        x = self.decoder(x, mel_mask)
        mel = self.mel_linear(x)
        mel_post = mel + self.postnet(mel)
        return mel, mel_post, log_d_pred, p_pred, e_pred, src_mask, mel_mask


def fs2_loss(outputs, mel_tgt, durations, pitch, energy):
    mel, mel_post, log_d_pred, p_pred, e_pred, src_mask, mel_mask = outputs
    valid_src, valid_mel = ~src_mask, ~mel_mask
    log_d_tgt = torch.log(durations.float() + 1.0)
    mel_l = F.l1_loss(mel[valid_mel], mel_tgt[valid_mel])
    post_l = F.l1_loss(mel_post[valid_mel], mel_tgt[valid_mel])
    dur_l = F.mse_loss(log_d_pred[valid_src], log_d_tgt[valid_src])
    pitch_l = F.mse_loss(p_pred[valid_src], pitch[valid_src])
    energy_l = F.mse_loss(e_pred[valid_src], energy[valid_src])
    total = mel_l + post_l + dur_l + pitch_l + energy_l
    return total, torch.stack([mel_l, post_l, dur_l, pitch_l, energy_l]).detach()


def noam_lambda(warmup, d_model):
    return lambda step: (d_model ** -0.5) * min((step + 1) ** -0.5, (step + 1) * warmup ** -1.5)


def to_device(batch, device):
    return [b.to(device, non_blocking=True) if torch.is_tensor(b) else b for b in batch]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out_dir", default="exp/fs2")
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    stats = np.load(os.path.join(cfg["data_dir"], "stats.npy"))  # written once by preprocess.py
    train_set = FS2Dataset(cfg["data_dir"], "train.txt")
    val_set = FS2Dataset(cfg["data_dir"], "val.txt")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # plain strided shard for validation: no padding duplicates, shards may differ by one
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              collate_fn=fs2_collate, num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=cfg["batch_size"], shuffle=False,
                            collate_fn=fs2_collate, num_workers=2)

    model = FastSpeech2(cfg["model"], train_set.n_symbols, train_set.n_speakers, stats[0], stats[1])
    # the postnet batch is small per GPU, so normalise over all GPUs
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda(cfg["warmup_steps"], cfg["model"]["d_model"]))

    step, start_epoch = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step, start_epoch = ckpt["step"], ckpt["epoch"] + 1

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    writer = SummaryWriter(os.path.join(args.out_dir, "tb")) if rank == 0 else None
    accum = cfg["grad_accum"]

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(train_loader):
            ids, phones, src_lens, speakers, mels, mel_lens, durations, pitch, energy = to_device(batch, device)
            sync_now = (i + 1) % accum == 0
            if sync_now:
                out = model(phones, src_lens, speakers, durations, pitch, energy, mels.size(1))
                loss, parts = fs2_loss(out, mels, durations, pitch, energy)
                (loss / accum).backward()
            else:
                with model.no_sync():
                    out = model(phones, src_lens, speakers, durations, pitch, energy, mels.size(1))
                    loss, parts = fs2_loss(out, mels, durations, pitch, energy)
                    (loss / accum).backward()
            if not sync_now:
                continue

            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg["log_every"] == 0:
                dist.all_reduce(parts, op=dist.ReduceOp.AVG)
                if rank == 0:
                    for name, v in zip(["mel", "postnet", "duration", "pitch", "energy"], parts.tolist()):
                        writer.add_scalar(f"train/{name}", v, step)
                    writer.add_scalar("train/grad_norm", grad_norm.item(), step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

        # ---- validation over all ranks ----
        model.eval()
        totals = torch.zeros(6, device=device)
        with torch.no_grad():
            for batch in val_loader:
                ids, phones, src_lens, speakers, mels, mel_lens, durations, pitch, energy = to_device(batch, device)
                out = model.module(phones, src_lens, speakers, durations, pitch, energy, mels.size(1))
                _, parts = fs2_loss(out, mels, durations, pitch, energy)
                n = phones.size(0)
                totals[:5] += parts * n
                totals[5] += n
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        val = (totals[:5] / totals[5]).tolist()
        if rank == 0:
            print(f"epoch {epoch} step {step} val mel {val[0]:.4f} post {val[1]:.4f} dur {val[2]:.4f} "
                  f"pitch {val[3]:.4f} energy {val[4]:.4f}")
            for name, v in zip(["mel", "postnet", "duration", "pitch", "energy"], val):
                writer.add_scalar(f"val/{name}", v, step)

        if rank == 0 and (epoch + 1) % cfg["save_every"] == 0:
            os.makedirs(args.out_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch},
                       os.path.join(args.out_dir, f"fs2_{step:07d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
