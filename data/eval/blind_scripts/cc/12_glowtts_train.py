"""Glow-TTS training with torchrun + native AMP.

    torchrun --standalone --nproc_per_node=4 12_glowtts_train.py -c configs/base.json -m base
"""
import argparse
import glob
import json
import logging
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import commons
import models
from data_utils import TextMelCollate, TextMelLoader
from text.symbols import symbols
from utils import HParams, plot_alignment_to_numpy, plot_spectrogram_to_numpy

logger = logging.getLogger("glowtts")


class NoamOptimizer:
    def __init__(self, params, lr, dim_model, warmup_steps=4000, betas=(0.9, 0.98), eps=1e-9):
        self.base_lr, self.dim_model, self.warmup_steps = lr, dim_model, warmup_steps
        self.step_num = 1
        self.cur_lr = self._get_lr()
        self._optim = torch.optim.Adam(params, lr=self.cur_lr, betas=betas, eps=eps)

    def _get_lr(self):
        return self.base_lr * (self.dim_model ** -0.5) * min(self.step_num ** -0.5,
                                                             self.step_num * self.warmup_steps ** -1.5)

    @property
    def optimizer(self):
        return self._optim

    def step(self, scaler):
        self.step_num += 1
        self.cur_lr = self._get_lr()
        for g in self._optim.param_groups:
            g["lr"] = self.cur_lr
        scaler.step(self._optim)

    def zero_grad(self):
        self._optim.zero_grad(set_to_none=True)

    def state_dict(self):
        return {"optim": self._optim.state_dict(), "step_num": self.step_num}

    def load_state_dict(self, d):
        self._optim.load_state_dict(d["optim"])
        self.step_num = d["step_num"]
        self.cur_lr = self._get_lr()


def latest_checkpoint(model_dir, pattern="G_*.pth"):
    paths = glob.glob(os.path.join(model_dir, pattern))
    if not paths:
        return None
    return max(paths, key=lambda p: int("".join(filter(str.isdigit, os.path.basename(p)))))


def save_checkpoint(model, optimizer, scaler, epoch, global_step, path):
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict(), "epoch": epoch, "global_step": global_step}
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)


def get_hparams():
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", default="./configs/base.json")
    parser.add_argument("-m", "--model", required=True)
    args = parser.parse_args()
    with open(args.config) as f:
        hps = HParams(**json.load(f))
    hps.model_dir = os.path.join("./logs", args.model)
    return hps


def main():
    hps = get_hparams()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    torch.manual_seed(hps.train.seed)

    writer = writer_eval = None
    if rank == 0:
        os.makedirs(hps.model_dir, exist_ok=True)
        writer = SummaryWriter(hps.model_dir)
        writer_eval = SummaryWriter(os.path.join(hps.model_dir, "eval"))

    collate_fn = TextMelCollate(1)
    train_dataset = TextMelLoader(hps.data.training_files, hps.data)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_dataset, num_workers=8, shuffle=False, batch_size=hps.train.batch_size,
                              pin_memory=True, drop_last=True, collate_fn=collate_fn, sampler=train_sampler)
    val_dataset = TextMelLoader(hps.data.validation_files, hps.data)
    val_sampler = DistributedSampler(val_dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_dataset, num_workers=4, shuffle=False, batch_size=hps.train.batch_size,
                            pin_memory=True, drop_last=False, collate_fn=collate_fn, sampler=val_sampler)

    generator = models.FlowGenerator(n_vocab=len(symbols) + getattr(hps.data, "add_blank", False),
                                     out_channels=hps.data.n_mel_channels, **hps.model).to(device)
    optimizer = NoamOptimizer(generator.parameters(), hps.train.learning_rate, hps.model.hidden_channels,
                              hps.train.warmup_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=hps.train.fp16_run)

    epoch_str, global_step = 1, 0
    ckpt = latest_checkpoint(hps.model_dir)
    if ckpt is not None:
        state = torch.load(ckpt, map_location="cpu")
        generator.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        epoch_str, global_step = state["epoch"] + 1, state["global_step"]
        logger.info(f"resumed from {ckpt} (epoch {state['epoch']}, step {global_step})")
    elif hps.train.ddi:
        # data-dependent init of the actnorm layers, done on one batch before wrapping
        for x, x_lengths, y, y_lengths in train_loader:
            x, x_lengths, y, y_lengths = x.to(device), x_lengths.to(device), y.to(device), y_lengths.to(device)
            for f in generator.modules():
                if getattr(f, "set_ddi", False):
                    f.set_ddi(True)
            with torch.no_grad():
                generator(x, x_lengths, y, y_lengths, gen=False)
            break
    generator = DDP(generator, device_ids=[local_rank])

    for epoch in range(epoch_str, hps.train.epochs + 1):
        train_sampler.set_epoch(epoch)
        generator.train()
        for batch_idx, (x, x_lengths, y, y_lengths) in enumerate(train_loader):
            x, x_lengths = x.to(device, non_blocking=True), x_lengths.to(device, non_blocking=True)
            y, y_lengths = y.to(device, non_blocking=True), y_lengths.to(device, non_blocking=True)

            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16, enabled=hps.train.fp16_run):
                (z, z_m, z_logs, logdet, z_mask), (x_m, x_logs, x_mask), (attn, logw, logw_) = \
                    generator(x, x_lengths, y, y_lengths, gen=False)
            l_mle = commons.mle_loss(z.float(), z_m.float(), z_logs.float(), logdet.float(), z_mask)
            l_length = commons.duration_loss(logw.float(), logw_.float(), x_lengths)
            loss_gs = [l_mle, l_length]
            loss_g = sum(loss_gs)

            if not torch.isfinite(loss_g):
                logger.warning(f"non-finite loss at step {global_step} (mle={l_mle.item()}), skipping batch")
                optimizer.zero_grad()
                continue

            scaler.scale(loss_g).backward()
            scaler.unscale_(optimizer.optimizer)
            grad_norm = commons.clip_grad_value_(generator.parameters(), 5)
            optimizer.step(scaler)
            scaler.update()

            if rank == 0 and global_step % hps.train.log_interval == 0:
                with torch.no_grad():
                    y_gen, *_ = generator.module(x[:1], x_lengths[:1], gen=True)
                logger.info(f"Train Epoch: {epoch} [{100.0 * batch_idx / len(train_loader):.0f}%] "
                            f"mle {l_mle.item():.4f} dur {l_length.item():.4f} lr {optimizer.cur_lr:.2e}")
                writer.add_scalar("loss/g/total", loss_g.item(), global_step)
                writer.add_scalar("loss/g/mle", l_mle.item(), global_step)
                writer.add_scalar("loss/g/length", l_length.item(), global_step)
                writer.add_scalar("learning_rate", optimizer.cur_lr, global_step)
                writer.add_scalar("grad_norm", grad_norm, global_step)
                writer.add_image("y_org", plot_spectrogram_to_numpy(y[0].data.cpu().numpy()), global_step, dataformats="HWC")
                writer.add_image("y_gen", plot_spectrogram_to_numpy(y_gen[0][0].data.cpu().numpy()), global_step,
                                 dataformats="HWC")
                writer.add_image("attn", plot_alignment_to_numpy(attn[0, 0].data.cpu().numpy()), global_step,
                                 dataformats="HWC")
            global_step += 1

        # evaluation: every rank scores its shard, totals are summed
        generator.eval()
        totals = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, x_lengths, y, y_lengths in val_loader:
                x, x_lengths, y, y_lengths = x.to(device), x_lengths.to(device), y.to(device), y_lengths.to(device)
                (z, z_m, z_logs, logdet, z_mask), _, (attn, logw, logw_) = \
                    generator.module(x, x_lengths, y, y_lengths, gen=False)
                totals[0] += commons.mle_loss(z, z_m, z_logs, logdet, z_mask) * x.size(0)
                totals[1] += commons.duration_loss(logw, logw_, x_lengths) * x.size(0)
                totals[2] += x.size(0)
        dist.all_reduce(totals)
        if rank == 0:
            n = totals[2].clamp(min=1)
            writer_eval.add_scalar("loss/g/mle", (totals[0] / n).item(), global_step)
            writer_eval.add_scalar("loss/g/length", (totals[1] / n).item(), global_step)
            logger.info(f"====> Epoch {epoch}: val mle {(totals[0] / n).item():.4f}")
            if epoch % hps.train.save_every_epochs == 0:
                save_checkpoint(generator, optimizer, scaler, epoch, global_step,
                                os.path.join(hps.model_dir, f"G_{global_step}.pth"))

    if rank == 0:
        writer.close()
        writer_eval.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
