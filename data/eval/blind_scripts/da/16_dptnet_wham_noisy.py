#!/usr/bin/env python3
"""DPTNet (asteroid implementation) on WHAM! sep_noisy, 8 kHz min.

    torchrun --standalone --nproc_per_node=4 16_dptnet_wham_noisy.py --wham_dir /data/wham/wav8k/min --exp exp/dptnet_wham
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from asteroid.losses import PITLossWrapper, pairwise_neg_sisdr
from asteroid.models import DPTNet
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("dptnet")


class WhamNoisy(Dataset):
    def __init__(self, split_dir, segment=None, sr=8000):
        self.d = split_dir
        self.names = sorted(os.listdir(os.path.join(split_dir, "mix_both")))
        self.seg = int(segment * sr) if segment else None
        if self.seg:
            self.names = [n for n in self.names if sf.info(os.path.join(split_dir, "mix_both", n)).frames >= self.seg]

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        n = self.names[i]
        kw = {"dtype": "float32"}
        if self.seg:
            total = sf.info(os.path.join(self.d, "mix_both", n)).frames
            start = random.randint(0, total - self.seg)
            kw.update(start=start, stop=start + self.seg)
        mix = sf.read(os.path.join(self.d, "mix_both", n), **kw)[0]
        s1 = sf.read(os.path.join(self.d, "s1", n), **kw)[0]
        s2 = sf.read(os.path.join(self.d, "s2", n), **kw)[0]
        return torch.from_numpy(mix), torch.from_numpy(np.stack([s1, s2]))


def noam_then_decay(step, d_model=64, warmup=4000, k1=0.2, k2=4e-4, steps_per_epoch=5000):
    step = max(step, 1)
    if step <= warmup:
        return k1 * d_model ** -0.5 * step * warmup ** -1.5
    epoch = step // steps_per_epoch
    return k2 * 0.98 ** (epoch // 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--wham_dir", required=True)
    p.add_argument("--exp", default="exp/dptnet_wham")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--segment", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--clip", type=float, default=5.0)
    args = p.parse_args()

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s")

    tr = WhamNoisy(os.path.join(args.wham_dir, "tr"), segment=args.segment)
    cv = WhamNoisy(os.path.join(args.wham_dir, "cv"))
    tr_sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, batch_size=args.batch_size, sampler=tr_sampler, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    cv_dl = DataLoader(Subset(cv, range(rank, len(cv), world)), batch_size=1, num_workers=2)

    model = DPTNet(n_src=2, ff_hid=256, chunk_size=100, n_repeats=6, norm_type="gLN", mask_act="relu",
                   bidirectional=True, dropout=0.0, kernel_size=16, n_filters=64, stride=8, sample_rate=8000)
    model = DDP(model.to(device), device_ids=[local_rank])
    loss_func = PITLossWrapper(pairwise_neg_sisdr, pit_from="pw_mtx")
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    spe = len(tr_dl)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: noam_then_decay(s, steps_per_epoch=spe))

    writer = SummaryWriter(os.path.join(args.exp, "tb")) if rank == 0 else None
    ckpt_path = os.path.join(args.exp, "last.ckpt")
    start_epoch, best = 0, float("inf")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    global_step = start_epoch * spe
    for epoch in range(start_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        tr_sum = torch.zeros(2, device=device)
        for mix, srcs in tr_dl:
            mix, srcs = mix.to(device, non_blocking=True), srcs.to(device, non_blocking=True)
            est = model(mix)
            loss = loss_func(est, srcs)
            if not math.isfinite(loss.item()):
                logger.warning("non-finite loss at step %d, skipping batch", global_step)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            global_step += 1
            tr_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            if writer is not None and global_step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], global_step)

        model.eval()
        cv_sum = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for mix, srcs in cv_dl:
                mix, srcs = mix.to(device), srcs.to(device)
                cv_sum[0] += loss_func(model.module(mix), srcs).double()
                cv_sum[1] += 1
        dist.all_reduce(tr_sum)
        dist.all_reduce(cv_sum)
        cv_loss = (cv_sum[0] / cv_sum[1]).item()

        if rank == 0:
            logger.info("epoch %d train %.3f cv %.3f", epoch, (tr_sum[0] / tr_sum[1]).item(), cv_loss)
            writer.add_scalar("cv/neg_sisdr", cv_loss, epoch)
            best = min(best, cv_loss)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
            if best == cv_loss:
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best_model.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
