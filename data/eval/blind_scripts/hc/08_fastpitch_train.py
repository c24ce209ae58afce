#!/usr/bin/env python
# FastPitch training (multi-speaker, pitch + energy conditioning) with DDP.
#
#   torchrun --nproc_per_node 8 08_fastpitch_train.py -o exp/fastpitch_hifitts \
#       --dataset-path data/hifitts --training-files filelists/hifitts_train.txt \
#       --validation-files filelists/hifitts_val.txt --epochs 1000 -bs 16
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from common.text import symbols
from fastpitch.model import FastPitch
from fastpitch.loss_function import FastPitchLoss
from fastpitch.data_function import TTSDataset, TTSCollate, batch_to_gpu
from fastpitch.attn_loss_function import AttentionBinarizationLoss


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("-o", "--output", required=True)
    p.add_argument("-d", "--dataset-path", default="./")
    p.add_argument("--training-files", required=True)
    p.add_argument("--validation-files", required=True)
    p.add_argument("--pitch-mean-std-file", default=None)
    p.add_argument("--n-speakers", type=int, default=10)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("-bs", "--batch-size", type=int, default=16)
    p.add_argument("-lr", "--learning-rate", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--weight-decay", type=float, default=1e-6)
    p.add_argument("--grad-clip-thresh", type=float, default=1000.0)
    p.add_argument("--max-mel-frames", type=int, default=1600,
                   help="batches with longer utterances are not used (activation memory)")
    p.add_argument("--kl-loss-start-epoch", type=int, default=250)
    p.add_argument("--kl-loss-warmup-epochs", type=int, default=100)
    p.add_argument("--kl-loss-weight", type=float, default=1.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--epochs-per-checkpoint", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def adjust_learning_rate(step, optimizer, lr, warmup):
    scale = 1.0 / (warmup ** 0.5) * min(1.0 / (step ** 0.5), step / (warmup ** 1.5)) if step > 0 else 0.0
    for g in optimizer.param_groups:
        g["lr"] = lr * scale


def reduce_mean(t, world):
    rt = t.detach().clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / world


def validate(model, criterion, loader, device):
    model.eval()
    tot = torch.zeros(3, device=device)
    with torch.no_grad():
        for batch in loader:
            x, y, num_frames = batch_to_gpu(batch)
            y_pred = model.module(x)
            loss, meta = criterion(y_pred, y, is_training=False)
            n = num_frames.sum().float()
            tot += torch.stack([loss * n, meta["mel_loss"] * n, n])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    tb = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        tb = SummaryWriter(os.path.join(args.output, "tb"))

    model = FastPitch(n_mel_channels=80, n_symbols=len(symbols("english_basic")), padding_idx=0,
                      n_speakers=args.n_speakers, energy_conditioning=True).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.98), eps=1e-9,
                                 weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = FastPitchLoss(dur_predictor_loss_scale=0.1, pitch_predictor_loss_scale=0.1,
                              attn_loss_scale=1.0, energy_predictor_loss_scale=0.1)
    attention_kl_loss = AttentionBinarizationLoss()

    start_epoch, total_iter = 1, 0
    ckpt_file = os.path.join(args.output, "FastPitch_checkpoint_last.pt")
    if os.path.exists(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, total_iter = ckpt["epoch"] + 1, ckpt["iteration"]

    trainset = TTSDataset(args.dataset_path, args.training_files, n_speakers=args.n_speakers,
                          pitch_mean_std_file=args.pitch_mean_std_file, load_pitch_from_disk=True)
    valset = TTSDataset(args.dataset_path, args.validation_files, n_speakers=args.n_speakers,
                        pitch_mean_std_file=args.pitch_mean_std_file, load_pitch_from_disk=True)
    collate_fn = TTSCollate()
    train_sampler = DistributedSampler(trainset, shuffle=True, seed=args.seed)
    train_loader = DataLoader(trainset, num_workers=4, shuffle=False, sampler=train_sampler,
                              batch_size=args.batch_size, pin_memory=True, persistent_workers=True,
                              drop_last=True, collate_fn=collate_fn)
    val_shard = torch.utils.data.Subset(valset, list(range(rank, len(valset), world)))
    val_loader = DataLoader(val_shard, num_workers=4, shuffle=False,
                            batch_size=args.batch_size, pin_memory=False, collate_fn=collate_fn)

    model.train()
    for epoch in range(start_epoch, args.epochs + 1):
        t0 = time.perf_counter()
        train_sampler.set_epoch(epoch)
        if epoch >= args.kl_loss_start_epoch:
            kl_weight = min((epoch - args.kl_loss_start_epoch) / args.kl_loss_warmup_epochs, 1.0) * args.kl_loss_weight
        else:
            kl_weight = 0.0

        epoch_loss, epoch_frames, n_iters = 0.0, 0, 0
        for batch in train_loader:
            x, y, num_frames = batch_to_gpu(batch)
            if y[0].size(2) > args.max_mel_frames:
                continue

            total_iter += 1
            adjust_learning_rate(total_iter, optimizer, args.learning_rate, args.warmup_steps)
            optimizer.zero_grad(set_to_none=True)

            with torch.cuda.amp.autocast(enabled=args.amp):
                y_pred = model(x)
                loss, meta = criterion(y_pred, y)
                if kl_weight > 0:
                    _, _, _, _, _, _, _, _, attn_soft, attn_hard, _, _ = y_pred
                    binarization_loss = attention_kl_loss(attn_hard, attn_soft)
                    loss = loss + kl_weight * binarization_loss

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_thresh)
            scaler.step(optimizer)
            scaler.update()

            reduced_loss = reduce_mean(loss, world).item()
            reduced_frames = reduce_mean(num_frames.float(), world).item() * world
            epoch_loss += reduced_loss
            epoch_frames += reduced_frames
            n_iters += 1

            if rank == 0 and total_iter % 50 == 0:
                tb.add_scalar("train/loss", reduced_loss, total_iter)
                tb.add_scalar("train/mel_loss", meta["mel_loss"].item(), total_iter)
                tb.add_scalar("train/lr", optimizer.param_groups[0]["lr"], total_iter)
                tb.add_scalar("train/kl_weight", kl_weight, total_iter)

        epoch_time = time.perf_counter() - t0
        val_loss, val_mel = validate(model, criterion, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} | loss {epoch_loss / max(n_iters, 1):.4f} | "
                  f"{epoch_frames / epoch_time:.0f} frames/s | val {val_loss:.4f} (mel {val_mel:.4f})")
            tb.add_scalar("val/loss", val_loss, total_iter)
            tb.add_scalar("val/mel_loss", val_mel, total_iter)

            state = {"epoch": epoch, "iteration": total_iter, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "args": vars(args)}
            torch.save(state, ckpt_file)
            if epoch % args.epochs_per_checkpoint == 0:
                torch.save(state, os.path.join(args.output, f"FastPitch_checkpoint_{epoch}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
