#!/usr/bin/env python3
"""Parallel WaveGAN training on (mel, wav) pairs dumped by preprocess.py.

Batches are bucketed by utterance length; every item in a batch is cropped to the shortest
utterance of that batch (capped at batch_max_steps), so bucketing keeps the crop long.

    torchrun --nnodes=1 --nproc_per_node=4 10_parallel_wavegan.py --dumpdir dump/train --config conf/pwg.yaml
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter

from parallel_wavegan.losses import MultiResolutionSTFTLoss
from parallel_wavegan.models import ParallelWaveGANDiscriminator, ParallelWaveGANGenerator

logger = logging.getLogger("pwg")


class MelWavDataset(Dataset):
    def __init__(self, dumpdir):
        with open(os.path.join(dumpdir, "manifest.tsv")) as f:
            rows = [l.rstrip("\n").split("\t") for l in f if l.strip()]
        self.items = [(os.path.join(dumpdir, r[0]), int(r[1])) for r in rows]  # (npz path, n_frames)
        self.frame_lengths = [n for _, n in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        data = np.load(self.items[idx][0])
        return torch.from_numpy(data["mel"]).float(), torch.from_numpy(data["wav"]).float()


class BucketBatchSampler(Sampler):
    """Sort by length, cut into batches, shuffle the batches each epoch."""

    def __init__(self, lengths, batch_size, bucket_size_multiplier=100, drop_last=True, seed=0):
        self.lengths = lengths
        self.batch_size = batch_size
        self.bucket_size = batch_size * bucket_size_multiplier
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        batches = []
        for start in range(0, len(order), self.bucket_size):
            bucket = sorted(order[start:start + self.bucket_size], key=lambda i: self.lengths[i])
            for b in range(0, len(bucket), self.batch_size):
                batch = bucket[b:b + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        rng.shuffle(batches)
        return iter(batches)

    def __len__(self):
        n = len(self.lengths) // self.batch_size
        return n if self.drop_last else math.ceil(len(self.lengths) / self.batch_size)


class CropCollater:
    def __init__(self, hop_size, batch_max_steps, aux_context_window):
        self.hop = hop_size
        self.max_frames = batch_max_steps // hop_size
        self.ctx = aux_context_window

    def __call__(self, batch):
        n_frames = min(min(m.shape[0] for m, _ in batch) - 2 * self.ctx, self.max_frames)
        mels, wavs = [], []
        for mel, wav in batch:
            start = random.randint(self.ctx, mel.shape[0] - self.ctx - n_frames)
            mels.append(mel[start - self.ctx:start + n_frames + self.ctx])
            wavs.append(wav[start * self.hop:(start + n_frames) * self.hop])
        c = torch.stack(mels).transpose(1, 2)  # (B, n_mels, T')
        y = torch.stack(wavs).unsqueeze(1)     # (B, 1, T)
        z = torch.randn_like(y)
        return z, c, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dumpdir", required=True)
    ap.add_argument("--dev-dumpdir", default="dump/dev")
    ap.add_argument("--config", required=True)
    ap.add_argument("--outdir", default="exp/pwg")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    with open(args.config) as f:
        config = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s (%(module)s:%(lineno)d) %(levelname)s: %(message)s")
    torch.manual_seed(config["seed"])

    dataset = MelWavDataset(args.dumpdir)
    batch_sampler = BucketBatchSampler(dataset.frame_lengths, config["batch_size"], seed=config["seed"])
    collate = CropCollater(config["hop_size"], config["batch_max_steps"],
                           config["generator_params"]["aux_context_window"])
    loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate,
                        num_workers=config["num_workers"], pin_memory=True)

    generator = ParallelWaveGANGenerator(**config["generator_params"]).to(device)
    discriminator = ParallelWaveGANDiscriminator(**config["discriminator_params"]).to(device)
    stft_loss = MultiResolutionSTFTLoss(**config["stft_loss_params"]).to(device)
    opt_g = torch.optim.RAdam(generator.parameters(), **config["generator_optimizer_params"])
    opt_d = torch.optim.RAdam(discriminator.parameters(), **config["discriminator_optimizer_params"])
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, **config["generator_scheduler_params"])
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, **config["discriminator_scheduler_params"])

    steps, epochs = 0, 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        generator.load_state_dict(state["model"]["generator"])
        discriminator.load_state_dict(state["model"]["discriminator"])
        opt_g.load_state_dict(state["optimizer"]["generator"])
        opt_d.load_state_dict(state["optimizer"]["discriminator"])
        sched_g.load_state_dict(state["scheduler"]["generator"])
        sched_d.load_state_dict(state["scheduler"]["discriminator"])
        steps, epochs = state["steps"], state["epochs"]
        logger.info(f"resumed from {args.resume} at step {steps}")

    generator = DDP(generator, device_ids=[local_rank])
    discriminator = DDP(discriminator, device_ids=[local_rank])

    writer = None
    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)
        writer = SummaryWriter(args.outdir)
        with open(os.path.join(args.outdir, "config.yml"), "w") as f:
            yaml.dump(config, f, Dumper=yaml.Dumper)

    lambda_adv = config["lambda_adv"]
    disc_start = config["discriminator_train_start_steps"]
    finished = False
    while not finished:
        batch_sampler.set_epoch(epochs)
        for z, c, y in loader:
            z, c, y = z.to(device, non_blocking=True), c.to(device, non_blocking=True), y.to(device, non_blocking=True)

            y_ = generator(z, c)
            sc_loss, mag_loss = stft_loss(y_.squeeze(1), y.squeeze(1))
            gen_loss = sc_loss + mag_loss
            adv_loss = torch.zeros((), device=device)
            if steps > disc_start:
                p_ = discriminator(y_)
                adv_loss = torch.mean((1.0 - p_) ** 2)
                gen_loss = gen_loss + lambda_adv * adv_loss
            opt_g.zero_grad()
            gen_loss.backward()
            torch.nn.utils.clip_grad_norm_(generator.parameters(), config["generator_grad_norm"])
            opt_g.step()
            sched_g.step()

            real_loss = fake_loss = torch.zeros((), device=device)
            if steps > disc_start:
                with torch.no_grad():
                    y_ = generator(z, c)
                p = discriminator(y)
                p_ = discriminator(y_.detach())
                real_loss = torch.mean((1.0 - p) ** 2)
                fake_loss = torch.mean(p_ ** 2)
                dis_loss = real_loss + fake_loss
                opt_d.zero_grad()
                dis_loss.backward()
                torch.nn.utils.clip_grad_norm_(discriminator.parameters(), config["discriminator_grad_norm"])
                opt_d.step()
                sched_d.step()

            steps += 1
            if rank == 0 and steps % config["log_interval_steps"] == 0:
                writer.add_scalar("train/spectral_convergence_loss", sc_loss.item(), steps)
                writer.add_scalar("train/log_stft_magnitude_loss", mag_loss.item(), steps)
                writer.add_scalar("train/adversarial_loss", adv_loss.item(), steps)
                writer.add_scalar("train/real_loss", real_loss.item(), steps)
                writer.add_scalar("train/fake_loss", fake_loss.item(), steps)
                logger.info(f"(steps: {steps}) sc={sc_loss.item():.4f} mag={mag_loss.item():.4f} "
                            f"adv={adv_loss.item():.4f}")
            if rank == 0 and steps % config["save_interval_steps"] == 0:
                state = {
                    "model": {"generator": generator.module.state_dict(),
                              "discriminator": discriminator.module.state_dict()},
                    "optimizer": {"generator": opt_g.state_dict(), "discriminator": opt_d.state_dict()},
                    "scheduler": {"generator": sched_g.state_dict(), "discriminator": sched_d.state_dict()},
                    "steps": steps, "epochs": epochs,
                }
                torch.save(state, os.path.join(args.outdir, f"checkpoint-{steps}steps.pkl"))
                logger.info(f"saved checkpoint @ {steps} steps")
            if steps >= config["train_max_steps"]:
                finished = True
                break
        epochs += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
