"""FastSpeech2 with a reference (style) encoder for AISHELL-3, multi-GPU with torchrun."""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from dataset import Dataset
from model.modules import LengthRegulator, VariancePredictor, PostNet
from transformer import Encoder, Decoder
from utils.tools import get_mask_from_lengths, to_device, synth_one_sample


class ReferenceEncoder(nn.Module):
    def __init__(self, n_mels=80, channels=(32, 32, 64, 64, 128, 128), gru_dim=128):
        super().__init__()
        convs, in_ch = [], 1
        for ch in channels:
            convs += [nn.Conv2d(in_ch, ch, 3, 2, 1), nn.ReLU()]
            in_ch = ch
        self.convs = nn.Sequential(*convs)
        freq = n_mels
        for _ in channels:
            freq = (freq - 1) // 2 + 1
        self.gru = nn.GRU(channels[-1] * freq, gru_dim, batch_first=True)

    def forward(self, mels):
        x = self.convs(mels.unsqueeze(1))            # B, C, T', F'
        b, c, t, f = x.shape
        x = x.transpose(1, 2).reshape(b, t, c * f)
        _, h = self.gru(x)
        return h.squeeze(0)


class FastSpeech2(nn.Module):
    def __init__(self, preprocess_config, model_config, n_speakers):
        super().__init__()
        d = model_config["transformer"]["encoder_hidden"]
        self.encoder = Encoder(model_config)
        self.decoder = Decoder(model_config)
        self.speaker_emb = nn.Embedding(n_speakers, d)
        self.ref_encoder = ReferenceEncoder(preprocess_config["preprocessing"]["mel"]["n_mel_channels"], gru_dim=d)
        self.null_style = nn.Parameter(torch.zeros(1, d))
        self.cond_drop = model_config.get("style_cond_drop", 0.1)

        self.duration_predictor = VariancePredictor(model_config)
        self.pitch_predictor = VariancePredictor(model_config)
        self.energy_predictor = VariancePredictor(model_config)
        n_bins = model_config["variance_embedding"]["n_bins"]
        self.register_buffer("pitch_bins", torch.linspace(-3.0, 8.0, n_bins - 1))
        self.register_buffer("energy_bins", torch.linspace(-2.0, 9.0, n_bins - 1))
        self.pitch_embedding = nn.Embedding(n_bins, d)
        self.energy_embedding = nn.Embedding(n_bins, d)
        self.length_regulator = LengthRegulator()

        n_mels = preprocess_config["preprocessing"]["mel"]["n_mel_channels"]
        self.mel_linear = nn.Linear(model_config["transformer"]["decoder_hidden"], n_mels)
        self.postnet = PostNet()

    def forward(self, speakers, texts, src_lens, max_src_len, mels, mel_lens, max_mel_len,
                p_targets, e_targets, d_targets):
        src_masks = get_mask_from_lengths(src_lens, max_src_len)
        mel_masks = get_mask_from_lengths(mel_lens, max_mel_len)

        x = self.encoder(texts, src_masks)
        x = x + self.speaker_emb(speakers).unsqueeze(1)

        if self.training and random.random() < self.cond_drop:
            style = self.null_style.expand(x.size(0), -1)
        else:
            style = self.ref_encoder(mels)
        x = x + style.unsqueeze(1)

        log_d_pred = self.duration_predictor(x, src_masks)
        p_pred = self.pitch_predictor(x, src_masks)
        e_pred = self.energy_predictor(x, src_masks)
        x = x + self.pitch_embedding(torch.bucketize(p_targets, self.pitch_bins))
        x = x + self.energy_embedding(torch.bucketize(e_targets, self.energy_bins))
        x, _ = self.length_regulator(x, d_targets, max_mel_len)

        x, mel_masks = self.decoder(x, mel_masks)
        mel_out = self.mel_linear(x)
        postnet_out = self.postnet(mel_out) + mel_out
        return mel_out, postnet_out, p_pred, e_pred, log_d_pred, src_masks, mel_masks


def fastspeech2_loss(batch, outputs):
    mel_targets, p_targets, e_targets, d_targets = batch["mels"], batch["pitches"], batch["energies"], batch["durations"]
    mel_out, postnet_out, p_pred, e_pred, log_d_pred, src_masks, mel_masks = outputs
    src_keep, mel_keep = ~src_masks, ~mel_masks
    log_d_targets = torch.log(d_targets.float() + 1)

    mel_targets = mel_targets[:, :mel_masks.shape[1], :]
    mel_loss = F.l1_loss(mel_out.masked_select(mel_keep.unsqueeze(-1)), mel_targets.masked_select(mel_keep.unsqueeze(-1)))
    post_loss = F.l1_loss(postnet_out.masked_select(mel_keep.unsqueeze(-1)),
                          mel_targets.masked_select(mel_keep.unsqueeze(-1)))
    pitch_loss = F.mse_loss(p_pred.masked_select(src_keep), p_targets.masked_select(src_keep))
    energy_loss = F.mse_loss(e_pred.masked_select(src_keep), e_targets.masked_select(src_keep))
    dur_loss = F.mse_loss(log_d_pred.masked_select(src_keep), log_d_targets.masked_select(src_keep))
    total = mel_loss + post_loss + pitch_loss + energy_loss + dur_loss
    return total, [mel_loss, post_loss, pitch_loss, energy_loss, dur_loss]


def model_inputs(batch):
    return (batch["speakers"], batch["texts"], batch["src_lens"], batch["max_src_len"], batch["mels"],
            batch["mel_lens"], batch["max_mel_len"], batch["pitches"], batch["energies"], batch["durations"])


def main(args):
    preprocess_config = yaml.load(open(args.preprocess_config), Loader=yaml.FullLoader)
    model_config = yaml.load(open(args.model_config), Loader=yaml.FullLoader)
    train_config = yaml.load(open(args.train_config), Loader=yaml.FullLoader)

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(train_config["seed"])

    train_set = Dataset("train.txt", preprocess_config, train_config, sort=True, drop_last=True)
    val_set = Dataset("val.txt", preprocess_config, train_config, sort=False, drop_last=False)
    batch_size = train_config["optimizer"]["batch_size"]
    group_size = 4
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=batch_size * group_size, sampler=sampler,
                              collate_fn=train_set.collate_fn, num_workers=4, pin_memory=True, drop_last=True)

    with open(os.path.join(preprocess_config["path"]["preprocessed_path"], "speakers.json")) as f:
        n_speakers = len(json.load(f))

    model = FastSpeech2(preprocess_config, model_config, n_speakers).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt_cfg = train_config["optimizer"]
    optimizer = torch.optim.Adam(model.parameters(), lr=opt_cfg["lr"], betas=opt_cfg["betas"],
                                 eps=opt_cfg["eps"], weight_decay=opt_cfg["weight_decay"])
    warmup = opt_cfg["warm_up_step"]
    d_model = model_config["transformer"]["encoder_hidden"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: d_model ** -0.5 * min((s + 1) ** -0.5, (s + 1) * warmup ** -1.5) / opt_cfg["lr"])

    step = 1
    ckpt_dir = train_config["path"]["ckpt_path"]
    if args.restore_step:
        ckpt = torch.load(os.path.join(ckpt_dir, f"{args.restore_step}.pth.tar"), map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step = args.restore_step + 1

    writer = None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(train_config["path"]["log_path"], "train"))

    total_step = train_config["step"]["total_step"]
    grad_clip = opt_cfg["grad_clip_thresh"]
    epoch = 0
    pbar = tqdm(total=total_step, initial=step, disable=rank != 0)
    while step <= total_step:
        sampler.set_epoch(epoch)
        model.train()
        for batches in train_loader:
            for batch in batches:
                batch = to_device(batch, device)
                outputs = model(*model_inputs(batch))
                total_loss, losses = fastspeech2_loss(batch, outputs)

                optimizer.zero_grad(set_to_none=True)
                total_loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                optimizer.step()
                scheduler.step()

                if rank == 0 and step % train_config["step"]["log_step"] == 0:
                    names = ["mel", "postnet", "pitch", "energy", "duration"]
                    writer.add_scalar("loss/total", total_loss.item(), step)
                    for n, l in zip(names, losses):
                        writer.add_scalar(f"loss/{n}", l.item(), step)
                    writer.add_scalar("lr", scheduler.get_last_lr()[0], step)

                if rank == 0 and step % train_config["step"]["synth_step"] == 0:
                    model.eval()
                    with torch.no_grad():
                        vb = to_device(val_set.collate_fn([val_set[0]])[0], device)
                        out = model.module(*model_inputs(vb))
                    fig, wav_rec, wav_pred, tag = synth_one_sample(vb, out, None, model_config, preprocess_config)
                    writer.add_figure(f"synth/{tag}", fig, step)
                    model.train()

                if rank == 0 and step % train_config["step"]["save_step"] == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict()},
                               os.path.join(ckpt_dir, f"{step}.pth.tar"))

                step += 1
                pbar.update(1)
                if step > total_step:
                    break
            if step > total_step:
                break
        epoch += 1

    pbar.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--restore_step", type=int, default=0)
    parser.add_argument("-p", "--preprocess_config", type=str, required=True)
    parser.add_argument("-m", "--model_config", type=str, required=True)
    parser.add_argument("-t", "--train_config", type=str, required=True)
    main(parser.parse_args())
