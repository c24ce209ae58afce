#!/usr/bin/env python3
"""Parallel WaveGAN training (LJSpeech), single node, one process per GPU via mp.spawn.

python 13_pwg_spawn_train.py --config conf/parallel_wavegan.v1.yaml \
    --train-dumpdir dump/train_nodev/norm --dev-dumpdir dump/dev/norm --outdir exp/pwg_v1
"""
import argparse
import logging
import os
import random
import socket
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from parallel_wavegan.datasets import AudioMelDataset
from parallel_wavegan.losses import MultiResolutionSTFTLoss
from parallel_wavegan.models import ParallelWaveGANDiscriminator, ParallelWaveGANGenerator
from parallel_wavegan.utils import read_hdf5


def find_free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Collater:
    """Randomly crop aligned (audio, mel) segments; the auxiliary context is added on both sides."""

    def __init__(self, batch_max_steps, hop_size, aux_context_window):
        self.batch_max_steps = batch_max_steps
        self.hop_size = hop_size
        self.aux_context_window = aux_context_window
        self.batch_max_frames = batch_max_steps // hop_size

    def __call__(self, batch):
        batch = [b for b in batch if len(b[1]) > self.batch_max_frames + 2 * self.aux_context_window]
        xs, cs = [], []
        for x, c in batch:
            start = random.randint(self.aux_context_window,
                                   len(c) - self.batch_max_frames - self.aux_context_window)
            xs.append(x[start * self.hop_size:(start + self.batch_max_frames) * self.hop_size])
            cs.append(c[start - self.aux_context_window:start + self.batch_max_frames + self.aux_context_window])
        y = torch.tensor(np.array(xs), dtype=torch.float).unsqueeze(1)
        c = torch.tensor(np.array(cs), dtype=torch.float).transpose(2, 1)
        z = torch.randn(y.shape)
        return z, c, y


def save_checkpoint(path, steps, epoch, gen, disc, opt_g, opt_d, sch_g, sch_d):
    torch.save({
        "model": {"generator": gen.module.state_dict(), "discriminator": disc.module.state_dict()},
        "optimizer": {"generator": opt_g.state_dict(), "discriminator": opt_d.state_dict()},
        "scheduler": {"generator": sch_g.state_dict(), "discriminator": sch_d.state_dict()},
        "steps": steps, "epochs": epoch,
    }, path)


def worker(rank, world_size, args, config):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s (%(module)s:%(lineno)d) %(levelname)s: %(message)s")
    random.seed(config["seed"] + rank)
    np.random.seed(config["seed"] + rank)
    torch.manual_seed(config["seed"])

    train_set = AudioMelDataset(root_dir=args.train_dumpdir, audio_query="*.h5", mel_query="*.h5",
                                audio_load_fn=lambda x: read_hdf5(x, "wave"),
                                mel_load_fn=lambda x: read_hdf5(x, "feats"),
                                mel_length_threshold=config["batch_max_steps"] // config["hop_size"] + 4)
    dev_set = AudioMelDataset(root_dir=args.dev_dumpdir, audio_query="*.h5", mel_query="*.h5",
                              audio_load_fn=lambda x: read_hdf5(x, "wave"),
                              mel_load_fn=lambda x: read_hdf5(x, "feats"))
    collater = Collater(config["batch_max_steps"], config["hop_size"],
                        config["generator_params"]["aux_context_window"])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=config["batch_size"], sampler=sampler, collate_fn=collater,
                              num_workers=config["num_workers"], pin_memory=True, drop_last=True)

    generator = ParallelWaveGANGenerator(**config["generator_params"]).to(device)
    discriminator = ParallelWaveGANDiscriminator(**config["discriminator_params"]).to(device)
    stft_loss = MultiResolutionSTFTLoss(**config["stft_loss_params"]).to(device)
    mse = torch.nn.MSELoss()

    opt_g = torch.optim.RAdam(generator.parameters(), **config["generator_optimizer_params"])
    opt_d = torch.optim.RAdam(discriminator.parameters(), **config["discriminator_optimizer_params"])
    sch_g = torch.optim.lr_scheduler.StepLR(opt_g, **config["generator_scheduler_params"])
    sch_d = torch.optim.lr_scheduler.StepLR(opt_d, **config["discriminator_scheduler_params"])

    steps, epoch = 0, 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        generator.load_state_dict(state["model"]["generator"])
        discriminator.load_state_dict(state["model"]["discriminator"])
        opt_g.load_state_dict(state["optimizer"]["generator"])
        opt_d.load_state_dict(state["optimizer"]["discriminator"])
        sch_g.load_state_dict(state["scheduler"]["generator"])
        sch_d.load_state_dict(state["scheduler"]["discriminator"])
        steps, epoch = state["steps"], state["epochs"]
        logging.info(f"resumed from {args.resume} (step {steps})")

    # Generator and discriminator are separate DDP instances. Until discriminator_train_start_steps
    # the discriminator is never run, so its reducer simply has nothing to do.
    generator = DDP(generator, device_ids=[rank])
    discriminator = DDP(discriminator, device_ids=[rank])

    writer = SummaryWriter(args.outdir) if rank == 0 else None
    d_start = config["discriminator_train_start_steps"]
    lambda_adv = config["lambda_adv"]

    while steps < config["train_max_steps"]:
        sampler.set_epoch(epoch)
        for z, c, y in train_loader:
            z, c, y = z.to(device), c.to(device), y.to(device)

            # generator update
            y_ = generator(z, c)
            sc_loss, mag_loss = stft_loss(y_.squeeze(1), y.squeeze(1))
            gen_loss = sc_loss + mag_loss
            if steps > d_start:
                p_ = discriminator(y_)
                adv_loss = mse(p_, p_.new_ones(p_.size()))
                gen_loss = gen_loss + lambda_adv * adv_loss
            opt_g.zero_grad()
            gen_loss.backward()
            torch.nn.utils.clip_grad_norm_(generator.parameters(), config["generator_grad_norm"])
            opt_g.step()
            sch_g.step()

            # discriminator update
            if steps > d_start:
                with torch.no_grad():
                    y_ = generator(z, c)
                p = discriminator(y)
                p_ = discriminator(y_.detach())
                real_loss = mse(p, p.new_ones(p.size()))
                fake_loss = mse(p_, p_.new_zeros(p_.size()))
                dis_loss = real_loss + fake_loss
                opt_d.zero_grad()
                dis_loss.backward()
                torch.nn.utils.clip_grad_norm_(discriminator.parameters(), config["discriminator_grad_norm"])
                opt_d.step()
                sch_d.step()

            steps += 1
            if writer is not None and steps % config["log_interval_steps"] == 0:
                writer.add_scalar("train/spectral_convergence_loss", sc_loss.item(), steps)
                writer.add_scalar("train/log_stft_magnitude_loss", mag_loss.item(), steps)
                writer.add_scalar("train/generator_loss", gen_loss.item(), steps)
                if steps > d_start:
                    writer.add_scalar("train/discriminator_loss", dis_loss.item(), steps)

            if rank == 0 and steps % config["eval_interval_steps"] == 0:
                g = generator.module
                g.eval()
                tot, n = 0.0, 0
                with torch.no_grad():
                    for i in range(min(len(dev_set), 16)):
                        x_np, c_np = dev_set[i]
                        cc = torch.tensor(c_np, dtype=torch.float, device=device).T.unsqueeze(0)
                        cc = torch.nn.functional.pad(cc, (collater.aux_context_window,) * 2, mode="replicate")
                        zz = torch.randn(1, 1, c_np.shape[0] * config["hop_size"], device=device)
                        yy = torch.tensor(x_np, dtype=torch.float, device=device).unsqueeze(0)
                        out = g(zz, cc).squeeze(1)[:, :yy.size(1)]
                        sc, mag = stft_loss(out, yy[:, :out.size(1)])
                        tot += (sc + mag).item()
                        n += 1
                        if i < 3:
                            writer.add_audio(f"dev/{i}", out[0].clamp(-1, 1).cpu(), steps, config["sampling_rate"])
                writer.add_scalar("dev/stft_loss", tot / max(n, 1), steps)
                g.train()

            if rank == 0 and steps % config["save_interval_steps"] == 0:
                os.makedirs(args.outdir, exist_ok=True)
                save_checkpoint(os.path.join(args.outdir, f"checkpoint-{steps}steps.pkl"), steps, epoch,
                                generator, discriminator, opt_g, opt_d, sch_g, sch_d)

            if steps >= config["train_max_steps"]:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--train-dumpdir", required=True)
    parser.add_argument("--dev-dumpdir", required=True)
    parser.add_argument("--outdir", required=True)
    parser.add_argument("--resume", default="")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with open(args.config) as f:
        config = yaml.load(f, Loader=yaml.SafeLoader)
    if args.port == 0:
        args.port = find_free_port()
    world_size = torch.cuda.device_count()
    os.makedirs(args.outdir, exist_ok=True)
    with open(os.path.join(args.outdir, "config.yml"), "w") as f:
        yaml.safe_dump(config, f)
    mp.spawn(worker, args=(world_size, args, config), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
