# Conv-TasNet (BN variant) on Libri2Mix sep_noisy, 16 kHz.
#   torchrun --standalone --nproc_per_node=8 06_convtasnet_bn_libri2mix_noisy.py --root /data/Libri2Mix/wav16k/max
import argparse
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass

import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.functional.audio import permutation_invariant_training, scale_invariant_signal_distortion_ratio


@dataclass
class Config:
    root: str = "/data/Libri2Mix/wav16k/max"
    exp_dir: str = "exp/convtasnet_bn_noisy"
    sample_rate: int = 16000
    segment: float = 3.0
    n_filters: int = 512
    kernel_size: int = 32
    bn_chan: int = 128
    hid_chan: int = 512
    n_blocks: int = 8
    n_repeats: int = 3
    batch_size: int = 2
    epochs: int = 150
    lr: float = 1e-3
    weight_decay: float = 0.0
    num_workers: int = 6
    log_interval: int = 100


class LibriMixNoisy(Dataset):
    def __init__(self, root, split, segment, sr):
        self.df = pd.read_csv(os.path.join(root, "metadata", f"mixture_{split}_mix_both.csv"))
        self.seg = int(segment * sr) if segment else None
        if self.seg:
            self.df = self.df[self.df["length"] >= self.seg].reset_index(drop=True)

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        start = 0
        if self.seg:
            start = int(torch.randint(0, int(row["length"]) - self.seg + 1, (1,)))
        stop = start + self.seg if self.seg else None
        mix, _ = sf.read(row["mixture_path"], start=start, stop=stop, dtype="float32")
        s = [sf.read(row[f"source_{k}_path"], start=start, stop=stop, dtype="float32")[0] for k in (1, 2)]
        return torch.from_numpy(mix), torch.stack([torch.from_numpy(x) for x in s])


class TCNBlock(nn.Module):
    def __init__(self, bn_chan, hid_chan, dilation, with_res=True):
        super().__init__()
        self.shared = nn.Sequential(
            nn.Conv1d(bn_chan, hid_chan, 1), nn.PReLU(), nn.BatchNorm1d(hid_chan),
            nn.Conv1d(hid_chan, hid_chan, 3, padding=dilation, dilation=dilation, groups=hid_chan),
            nn.PReLU(), nn.BatchNorm1d(hid_chan),
        )
        self.res_conv = nn.Conv1d(hid_chan, bn_chan, 1) if with_res else None
        self.skip_conv = nn.Conv1d(hid_chan, bn_chan, 1)

    def forward(self, x):
        h = self.shared(x)
        return (self.res_conv(h) if self.res_conv is not None else None), self.skip_conv(h)


class ConvTasNetBN(nn.Module):
    def __init__(self, cfg: Config, n_src=2):
        super().__init__()
        self.n_src = n_src
        k = cfg.kernel_size
        self.encoder = nn.Conv1d(1, cfg.n_filters, k, stride=k // 2, bias=False)
        self.bottleneck = nn.Sequential(nn.BatchNorm1d(cfg.n_filters), nn.Conv1d(cfg.n_filters, cfg.bn_chan, 1))
        total = cfg.n_blocks * cfg.n_repeats
        self.tcn = nn.ModuleList([
            TCNBlock(cfg.bn_chan, cfg.hid_chan, 2 ** (i % cfg.n_blocks), with_res=(i < total - 1))
            for i in range(total)
        ])
        self.mask_conv = nn.Sequential(nn.PReLU(), nn.Conv1d(cfg.bn_chan, n_src * cfg.n_filters, 1))
        self.decoder = nn.ConvTranspose1d(cfg.n_filters, 1, k, stride=k // 2, bias=False)

    def forward(self, wav):
        n = wav.size(-1)
        tf = F.relu(self.encoder(wav.unsqueeze(1)))
        x = self.bottleneck(tf)
        skip_sum = torch.zeros_like(x)
        for blk in self.tcn:
            res, skip = blk(x)
            skip_sum = skip_sum + skip
            if res is not None:
                x = x + res
        masks = F.relu(self.mask_conv(skip_sum)).view(wav.size(0), self.n_src, -1, tf.size(-1))
        out = self.decoder((masks * tf.unsqueeze(1)).flatten(0, 1)).view(wav.size(0), self.n_src, -1)
        return F.pad(out, (0, max(0, n - out.size(-1))))[..., :n]


def pit_sisdr(est, ref):
    best, _ = permutation_invariant_training(est, ref, scale_invariant_signal_distortion_ratio,
                                            mode="speaker-wise", eval_func="max")
    return best


def run_validation(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    with torch.no_grad():
        for mix, ref in loader:
            mix, ref = mix.to(device), ref.to(device)
            est = net(mix)
            sdr = pit_sisdr(est, ref)
            sdr_in = pit_sisdr(mix.unsqueeze(1).repeat(1, 2, 1), ref)
            s[0] += sdr.sum()
            s[1] += (sdr - sdr_in).sum()
            s[2] += mix.size(0)
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    parser = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        parser.add_argument(f"--{f.name}", type=f.type, default=f.default)
    cfg = Config(**vars(parser.parse_args()))

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format=f"[rank{rank}] %(asctime)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    log = logging.getLogger()
    if rank == 0:
        os.makedirs(cfg.exp_dir, exist_ok=True)
        with open(os.path.join(cfg.exp_dir, "config.json"), "w") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2)

    train_ds = LibriMixNoisy(cfg.root, "train-360", cfg.segment, cfg.sample_rate)
    val_ds = LibriMixNoisy(cfg.root, "dev", None, cfg.sample_rate)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                          num_workers=cfg.num_workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=1, num_workers=2)

    model = ConvTasNetBN(cfg).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=5)

    best = float("-inf")
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        agg = torch.zeros(2, device=device)
        for it, (mix, ref) in enumerate(train_dl):
            mix, ref = mix.to(device, non_blocking=True), ref.to(device, non_blocking=True)
            loss = -pit_sisdr(model(mix), ref).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            optimizer.step()
            agg += torch.stack([loss.detach(), torch.ones_like(loss)])
            if it % cfg.log_interval == 0:
                log.info("epoch %d it %d loss %.3f", epoch, it, loss.item())
        dist.all_reduce(agg)

        val_sisdr, val_sisdri = run_validation(model.module, val_dl, device)
        scheduler.step(val_sisdri)
        log.info("epoch %d done in %.0fs train %.3f val SI-SDR %.2f SI-SDRi %.2f", epoch, time.time() - tic,
                 (agg[0] / agg[1]).item(), val_sisdr, val_sisdri)
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(cfg.exp_dir, "last.ckpt"))
            if val_sisdri > best:
                best = val_sisdri
                torch.save(model.module.state_dict(), os.path.join(cfg.exp_dir, "best_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
