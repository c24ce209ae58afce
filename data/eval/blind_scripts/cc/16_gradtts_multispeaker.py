"""Multi-speaker Grad-TTS (LibriTTS) with one process per GPU started by torch.multiprocessing.

    python 16_gradtts_multispeaker.py --log_dir logs/gradtts_libritts --n_gpus 8
"""
import argparse
import os
import socket
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import params
from data import TextMelSpeakerBatchCollate, TextMelSpeakerDataset
from model import GradTTS
from text.symbols import symbols
from utils import plot_tensor, save_plot


class LossWrapper(nn.Module):
    """Puts Grad-TTS' compute_loss behind forward() so DDP sees the whole training graph."""

    def __init__(self, model, out_size):
        super().__init__()
        self.model = model
        self.out_size = out_size

    def forward(self, x, x_lengths, y, y_lengths, spk):
        return self.model.compute_loss(x, x_lengths, y, y_lengths, spk=spk, out_size=self.out_size)


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build_model():
    return GradTTS(len(symbols) + 1, params.n_spks, params.spk_emb_dim, params.n_enc_channels,
                   params.filter_channels, params.filter_channels_dp, params.n_heads, params.n_enc_layers,
                   params.enc_kernel, params.enc_dropout, params.window_size, params.n_feats,
                   params.dec_dim, params.beta_min, params.beta_max, params.pe_scale)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=world_size, rank=rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(params.seed + rank)
    np.random.seed(params.seed + rank)

    train_ds = TextMelSpeakerDataset(params.train_filelist_path, params.cmudict_path, params.add_blank,
                                     params.n_fft, params.n_feats, params.sample_rate, params.hop_length,
                                     params.win_length, params.f_min, params.f_max)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=params.seed)
    loader = DataLoader(train_ds, batch_size=params.batch_size, sampler=sampler, collate_fn=TextMelSpeakerBatchCollate(),
                        drop_last=True, num_workers=8, pin_memory=True)

    model = build_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=params.learning_rate)
    start_epoch, iteration = 1, 0
    last = os.path.join(args.log_dir, "last.pt")
    if os.path.exists(last):
        ckpt = torch.load(last, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, iteration = ckpt["epoch"] + 1, ckpt["iteration"]
    net = DDP(LossWrapper(model, params.out_size), device_ids=[rank])

    logger, test_batch = None, None
    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
        logger = SummaryWriter(log_dir=args.log_dir)
        test_ds = TextMelSpeakerDataset(params.valid_filelist_path, params.cmudict_path, params.add_blank,
                                        params.n_fft, params.n_feats, params.sample_rate, params.hop_length,
                                        params.win_length, params.f_min, params.f_max)
        test_batch = test_ds.sample_test_batch(size=params.test_size)
        for i, item in enumerate(test_batch):
            logger.add_image(f"image_{i}/ground_truth", plot_tensor(item["y"].squeeze()),
                             global_step=0, dataformats="HWC")

    for epoch in range(start_epoch, args.n_epochs + 1):
        sampler.set_epoch(epoch)
        net.train()
        sums = torch.zeros(4, device=device)
        it = tqdm(loader, total=len(loader), disable=rank != 0, desc=f"epoch {epoch}")
        for batch in it:
            x, x_lengths = batch["x"].to(device, non_blocking=True), batch["x_lengths"].to(device, non_blocking=True)
            y, y_lengths = batch["y"].to(device, non_blocking=True), batch["y_lengths"].to(device, non_blocking=True)
            spk = batch["spk"].to(device, non_blocking=True)
            dur_loss, prior_loss, diff_loss = net(x, x_lengths, y, y_lengths, spk)
            loss = dur_loss + prior_loss + diff_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            enc_grad_norm = nn.utils.clip_grad_norm_(model.encoder.parameters(), max_norm=1)
            dec_grad_norm = nn.utils.clip_grad_norm_(model.decoder.parameters(), max_norm=1)
            optimizer.step()

            sums += torch.stack([dur_loss.detach(), prior_loss.detach(), diff_loss.detach(),
                                 torch.ones((), device=device)])
            if rank == 0:
                logger.add_scalar("training/duration_loss", dur_loss.item(), iteration)
                logger.add_scalar("training/prior_loss", prior_loss.item(), iteration)
                logger.add_scalar("training/diffusion_loss", diff_loss.item(), iteration)
                logger.add_scalar("training/encoder_grad_norm", enc_grad_norm, iteration)
                logger.add_scalar("training/decoder_grad_norm", dec_grad_norm, iteration)
                it.set_postfix(dur=f"{dur_loss.item():.3f}", prior=f"{prior_loss.item():.3f}",
                               diff=f"{diff_loss.item():.3f}")
            iteration += 1

        dist.all_reduce(sums)
        mean = (sums[:3] / sums[3]).tolist()
        if rank == 0:
            with open(os.path.join(args.log_dir, "train.log"), "a") as f:
                f.write(f"Epoch {epoch}: duration loss = {mean[0]:.3f} | prior loss = {mean[1]:.3f} | "
                        f"diffusion loss = {mean[2]:.3f}\n")

        if rank == 0 and epoch % params.save_every == 0:
            model.eval()
            with torch.no_grad():
                for i, item in enumerate(test_batch):
                    x = item["x"].to(torch.long).unsqueeze(0).to(device)
                    x_lengths = torch.LongTensor([x.shape[-1]]).to(device)
                    spk = torch.LongTensor([item["spk"]]).to(device)
                    y_enc, y_dec, attn = model(x, x_lengths, n_timesteps=50, spk=spk)
                    logger.add_image(f"image_{i}/generated_enc", plot_tensor(y_enc.squeeze().cpu()),
                                     global_step=iteration, dataformats="HWC")
                    logger.add_image(f"image_{i}/generated_dec", plot_tensor(y_dec.squeeze().cpu()),
                                     global_step=iteration, dataformats="HWC")
                    logger.add_image(f"image_{i}/alignment", plot_tensor(attn.squeeze().cpu()),
                                     global_step=iteration, dataformats="HWC")
                    save_plot(y_dec.squeeze().cpu(), os.path.join(args.log_dir, f"generated_dec_{i}.png"))
            model.train()
            torch.save(model.state_dict(), os.path.join(args.log_dir, f"grad_{epoch}.pt"))
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "iteration": iteration}, last + ".tmp")
            os.replace(last + ".tmp", last)
        dist.barrier()

    if logger is not None:
        logger.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--log_dir", default=params.log_dir)
    ap.add_argument("--n_epochs", type=int, default=params.n_epochs)
    ap.add_argument("--n_gpus", type=int, default=torch.cuda.device_count())
    args = ap.parse_args()
    assert 0 < args.n_gpus <= torch.cuda.device_count(), "asked for more GPUs than are visible"
    args.port = free_port()
    mp.spawn(worker, args=(args.n_gpus, args), nprocs=args.n_gpus, join=True)


if __name__ == "__main__":
    main()
