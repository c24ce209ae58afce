#!/usr/bin/env python
# DPRNN-TasNet on noisy 2-speaker mixtures built on the fly from WSJ0 si_tr_s + WHAM! noise.
# Speaker-disjoint validation split is carved out of si_tr_s.
#
#   torchrun --standalone --nproc_per_node=4 08_dprnn_wham_dynamic_mixing.py \
#       --wsj0 /data/wsj0_wav8k/si_tr_s --wham_noise /data/wham_noise/tr --exp exp/dprnn_dm
import argparse
import glob
import os
import random
from collections import defaultdict

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from asteroid.losses import PITLossWrapper, pairwise_neg_sisdr
from asteroid.models import DPRNNTasNet
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SR = 8000


def read_segment(path, seg, rng):
    n = sf.info(path).frames
    if n <= seg:
        x, _ = sf.read(path, dtype="float32")
        return np.pad(x, (0, seg - n))
    o = rng.randint(0, n - seg)
    return sf.read(path, start=o, stop=o + seg, dtype="float32")[0]


class DynamicMixing(Dataset):
    def __init__(self, utts_by_spk, noise_files, epoch_size, segment=4.0, snr_db=(-6.0, 3.0), fixed_seed=None):
        self.spk = sorted(utts_by_spk)
        self.utts = utts_by_spk
        self.noise = noise_files
        self.epoch_size = epoch_size
        self.seg = int(segment * SR)
        self.snr_db = snr_db
        self.fixed_seed = fixed_seed

    def __len__(self):
        return self.epoch_size

    def __getitem__(self, idx):
        rng = random.Random(self.fixed_seed + idx) if self.fixed_seed is not None else random
        s1, s2 = rng.sample(self.spk, 2)
        srcs = [read_segment(rng.choice(self.utts[s]), self.seg, rng) for s in (s1, s2)]
        gain_db = rng.uniform(-2.5, 2.5)
        srcs[0] = srcs[0] * 10 ** (gain_db / 20)
        srcs[1] = srcs[1] * 10 ** (-gain_db / 20)
        noise = read_segment(rng.choice(self.noise), self.seg, rng)
        speech = srcs[0] + srcs[1]
        snr = rng.uniform(*self.snr_db)
        noise = noise * np.sqrt((speech ** 2).mean() / ((noise ** 2).mean() * 10 ** (snr / 10) + 1e-10))
        mix = speech + noise
        norm = max(1.0, np.abs(mix).max() / 0.9)
        return torch.from_numpy((mix / norm).astype(np.float32)), torch.from_numpy((np.stack(srcs) / norm).astype(np.float32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wsj0", required=True)
    ap.add_argument("--wham_noise", required=True)
    ap.add_argument("--exp", default="exp/dprnn_dm")
    ap.add_argument("--valid_frac", type=float, default=0.08)
    ap.add_argument("--epoch_size", type=int, default=20000)
    ap.add_argument("--valid_size", type=int, default=3000)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # every GPU draws its own mixtures
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    utts_by_spk = defaultdict(list)
    for f in sorted(glob.glob(os.path.join(args.wsj0, "*", "*.wav"))):
        utts_by_spk[os.path.basename(os.path.dirname(f))].append(f)
    speakers = sorted(utts_by_spk)
    random.shuffle(speakers)
    n_valid = max(2, int(round(args.valid_frac * len(speakers))))
    valid_spk, train_spk = speakers[:n_valid], speakers[n_valid:]
    noise = sorted(glob.glob(os.path.join(args.wham_noise, "*.wav")))

    train_set = DynamicMixing({s: utts_by_spk[s] for s in train_spk}, noise, args.epoch_size)
    valid_set = DynamicMixing({s: utts_by_spk[s] for s in valid_spk}, noise, args.valid_size, fixed_seed=1234)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=args.batch_size, sampler=valid_sampler, num_workers=4)

    model = DPRNNTasNet(n_src=2, n_repeats=6, bn_chan=128, hid_size=128, chunk_size=100, hop_size=50,
                        n_filters=64, kernel_size=16, stride=8, sample_rate=SR).to(device)
    model = DDP(model, device_ids=[local_rank])
    loss_func = PITLossWrapper(pairwise_neg_sisdr, pit_from="pw_mtx")
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=8)

    writer = None
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        writer = SummaryWriter(args.exp)
        writer.add_text("split", f"{len(train_spk)} train speakers, {len(valid_spk)} valid speakers")
    best = float("inf")

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tr = torch.zeros(2, device=device)
        for mix, srcs in train_loader:
            mix, srcs = mix.to(device, non_blocking=True), srcs.to(device, non_blocking=True)
            loss = loss_func(model(mix), srcs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            tr[0] += loss.detach()
            tr[1] += 1

        model.eval()
        va = torch.zeros(2, device=device)
        with torch.no_grad():
            for mix, srcs in valid_loader:
                mix, srcs = mix.to(device), srcs.to(device)
                va[0] += loss_func(model.module(mix), srcs) * mix.size(0)
                va[1] += mix.size(0)
        dist.all_reduce(tr)
        dist.all_reduce(va)
        train_loss, valid_loss = (tr[0] / tr[1]).item(), (va[0] / va[1]).item()
        scheduler.step(valid_loss)

        if rank == 0:
            writer.add_scalar("loss/train", train_loss, epoch)
            writer.add_scalar("loss/valid", valid_loss, epoch)
            writer.add_scalar("lr", optimizer.param_groups[0]["lr"], epoch)
            print(f"epoch {epoch:3d} train {train_loss:.3f} valid {valid_loss:.3f}", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "train_spk": train_spk, "valid_spk": valid_spk}
            torch.save(state, os.path.join(args.exp, "last.pth"))
            if valid_loss < best:
                best = valid_loss
                torch.save(state, os.path.join(args.exp, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
