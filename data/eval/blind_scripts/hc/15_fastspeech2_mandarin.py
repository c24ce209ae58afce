# -*- coding: utf-8 -*-
"""FastSpeech2 for Mandarin (Biaobei / CSMSC), pinyin + tone input, 24 kHz mels for a HiFi-GAN vocoder.

    torchrun --nproc_per_node=4 15_fastspeech2_mandarin.py --conf conf/fs2_csmsc.yaml --outdir exp/fs2_csmsc
"""
import argparse
import logging
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from fs2.dataset import CSMSCDataset, Collater
from fs2.model import FastSpeech2
from fs2.loss import FastSpeech2Loss
from fs2.frontend import load_phone_dict

logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                    format="%(asctime)s (%(module)s:%(lineno)d) %(levelname)s: %(message)s")


def get_args():
    parser = argparse.ArgumentParser(description="Train FastSpeech2 (Mandarin).")
    parser.add_argument("--conf", type=str, required=True)
    parser.add_argument("--outdir", type=str, required=True)
    parser.add_argument("--resume", type=str, default="")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=1)
    return parser.parse_args()


def noam_lambda(warmup, d_model):
    def f(step):
        step = max(step, 1)
        return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    return f


def main():
    args = get_args()
    with open(args.conf) as f:
        config = yaml.safe_load(f)

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARN)

    np.random.seed(config["seed"])
    torch.manual_seed(config["seed"])
    torch.backends.cudnn.benchmark = True

    phone_dict = load_phone_dict(config["phone_dict"])
    train_set = CSMSCDataset(config["train_dumpdir"], phone_dict, stats_file=config["stats"],
                             max_mel_len=config["max_mel_len"])
    dev_set = CSMSCDataset(config["dev_dumpdir"], phone_dict, stats_file=config["stats"])
    collater = Collater()
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=config["batch_size"], sampler=train_sampler,
                              collate_fn=collater, num_workers=config["num_workers"], pin_memory=True,
                              drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=config["batch_size"], shuffle=False, collate_fn=collater,
                            num_workers=2)
    logging.info(f"train: {len(train_set)} utts, dev: {len(dev_set)} utts, {world_size} GPUs")

    model = FastSpeech2(idim=len(phone_dict), odim=config["n_mels"], **config["model"]).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    criterion = FastSpeech2Loss(use_masking=True).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, noam_lambda(config["warmup_steps"], config["model"]["adim"]))
    scaler = GradScaler(enabled=config.get("use_amp", True))

    step, epoch = 0, 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        step, epoch = state["step"], state["epoch"]
        logging.info(f"resumed from {args.resume} at step {step}")

    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.outdir, "checkpoints"), exist_ok=True)
        writer = SummaryWriter(os.path.join(args.outdir, "tensorboard"))
        with open(os.path.join(args.outdir, "config.yaml"), "w") as f:
            yaml.safe_dump(config, f, allow_unicode=True)

    train_max_steps = config["train_max_steps"]
    while step < train_max_steps:
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with autocast(enabled=scaler.is_enabled()):
                after_outs, before_outs, d_outs, p_outs, e_outs, ys, olens = model(
                    text=batch["text"], text_lengths=batch["text_lengths"], speech=batch["speech"],
                    speech_lengths=batch["speech_lengths"], durations=batch["durations"],
                    pitch=batch["pitch"], energy=batch["energy"])
                l1_loss, duration_loss, pitch_loss, energy_loss = criterion(
                    after_outs=after_outs, before_outs=before_outs, d_outs=d_outs, p_outs=p_outs,
                    e_outs=e_outs, ys=ys, ds=batch["durations"], ps=batch["pitch"], es=batch["energy"],
                    ilens=batch["text_lengths"], olens=olens)
                loss = l1_loss + duration_loss + pitch_loss + energy_loss

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            if rank == 0 and step % config["log_interval"] == 0:
                logging.info(f"(step {step}) loss {loss.item():.4f} l1 {l1_loss.item():.4f} "
                             f"dur {duration_loss.item():.4f} pitch {pitch_loss.item():.4f} "
                             f"energy {energy_loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")
                for name, val in (("train/loss", loss), ("train/l1_loss", l1_loss),
                                  ("train/duration_loss", duration_loss), ("train/pitch_loss", pitch_loss),
                                  ("train/energy_loss", energy_loss)):
                    writer.add_scalar(name, val.item(), step)
                writer.add_scalar("train/grad_norm", grad_norm.item(), step)

            if rank == 0 and step % config["eval_interval"] == 0:
                model.eval()
                tot, n = np.zeros(4), 0
                with torch.no_grad():
                    for dbatch in dev_loader:
                        dbatch = {k: v.to(device) for k, v in dbatch.items()}
                        outs = model.module(text=dbatch["text"], text_lengths=dbatch["text_lengths"],
                                            speech=dbatch["speech"], speech_lengths=dbatch["speech_lengths"],
                                            durations=dbatch["durations"], pitch=dbatch["pitch"],
                                            energy=dbatch["energy"])
                        after_outs, before_outs, d_outs, p_outs, e_outs, ys, olens = outs
                        ls = criterion(after_outs=after_outs, before_outs=before_outs, d_outs=d_outs,
                                       p_outs=p_outs, e_outs=e_outs, ys=ys, ds=dbatch["durations"],
                                       ps=dbatch["pitch"], es=dbatch["energy"],
                                       ilens=dbatch["text_lengths"], olens=olens)
                        tot += np.array([l.item() for l in ls])
                        n += 1
                tot /= max(n, 1)
                for name, val in zip(["l1_loss", "duration_loss", "pitch_loss", "energy_loss"], tot):
                    writer.add_scalar(f"dev/{name}", val, step)
                logging.info(f"(step {step}) dev l1 {tot[0]:.4f} dur {tot[1]:.4f}")
                model.train()

            if rank == 0 and step % config["save_interval"] == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                            "step": step, "epoch": epoch},
                           os.path.join(args.outdir, "checkpoints", f"checkpoint_{step}steps.pkl"))

            if step >= train_max_steps:
                break
        epoch += 1
        logging.info(f"epoch {epoch} finished in {time.time() - t0:.1f}s")

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
