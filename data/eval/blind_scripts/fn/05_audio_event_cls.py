"""Environmental sound classification on our field recordings (log-mel CNN).

    torchrun --nproc_per_node=4 05_audio_event_cls.py data.root=/datasets/fieldrec_v3 model=cnn14
"""
import csv
import logging
import os
import random

import hydra
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ClipDataset(Dataset):
    def __init__(self, root, meta_csv, sample_rate=32000, clip_seconds=5.0, n_mels=64):
        self.root = root
        with open(meta_csv) as f:
            rows = list(csv.DictReader(f))
        self.classes = sorted({r["label"] for r in rows})
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.items = [(r["filename"], self.class_to_idx[r["label"]]) for r in rows]
        self.sample_rate = sample_rate
        self.num_samples = int(sample_rate * clip_seconds)
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate, n_fft=1024, hop_length=320, n_mels=n_mels, f_min=50, f_max=14000)
        self.to_db = torchaudio.transforms.AmplitudeToDB(top_db=80)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        fname, label = self.items[idx]
        wav, sr = torchaudio.load(os.path.join(self.root, fname))
        wav = wav.mean(0, keepdim=True)
        if sr != self.sample_rate:
            wav = torchaudio.functional.resample(wav, sr, self.sample_rate)
        if wav.shape[1] < self.num_samples:
            wav = F.pad(wav, (0, self.num_samples - wav.shape[1]))
        else:
            start = random.randint(0, wav.shape[1] - self.num_samples)
            wav = wav[:, start:start + self.num_samples]
        return self.to_db(self.mel(wav)), label


class SpecAugment(nn.Module):
    def __init__(self, freq_mask=8, time_mask=40):
        super().__init__()
        self.f = torchaudio.transforms.FrequencyMasking(freq_mask)
        self.t = torchaudio.transforms.TimeMasking(time_mask)

    def forward(self, x):
        return self.t(self.f(x))


@torch.no_grad()
def evaluate(model, loader, device, num_classes):
    model.eval()
    conf = torch.zeros(num_classes, num_classes, device=device, dtype=torch.long)
    for spec, y in loader:
        spec, y = spec.to(device), y.to(device)
        pred = model(spec).argmax(1)
        idx = y * num_classes + pred
        conf += torch.bincount(idx, minlength=num_classes ** 2).view(num_classes, num_classes)
    dist.all_reduce(conf)
    acc = conf.diag().sum().item() / conf.sum().item()
    per_class = conf.diag().float() / conf.sum(1).clamp(min=1).float()
    return acc, per_class.mean().item()


@hydra.main(version_base=None, config_path="conf", config_name="audio")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different seed per rank so the crops / specaugment masks are not identical across GPUs
    seed_everything(cfg.seed + rank)

    out_dir = HydraConfig.get().runtime.output_dir
    writer = SummaryWriter(out_dir) if rank == 0 else None

    root = to_absolute_path(cfg.data.root)
    full = ClipDataset(os.path.join(root, "audio"), os.path.join(root, "meta.csv"),
                       sample_rate=cfg.data.sample_rate, clip_seconds=cfg.data.clip_seconds,
                       n_mels=cfg.data.n_mels)
    n_val = int(len(full) * cfg.data.val_fraction)
    train_set, val_set = random_split(full, [len(full) - n_val, n_val])
    num_classes = len(full.classes)
    if rank == 0:
        log.info("%d classes, %d train / %d val clips", num_classes, len(train_set), len(val_set))

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg.data.batch_size, sampler=val_sampler,
                            num_workers=cfg.data.workers, pin_memory=True)

    model = instantiate(cfg.model, num_classes=num_classes, in_mels=cfg.data.n_mels).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    specaug = SpecAugment(cfg.aug.freq_mask, cfg.aug.time_mask).to(device)

    optimizer = instantiate(cfg.optimizer, params=model.parameters())
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.optimizer.lr, total_steps=cfg.epochs * len(train_loader), pct_start=0.1)

    best = 0.0
    step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = 0.0
        for spec, y in train_loader:
            spec, y = spec.to(device, non_blocking=True), y.to(device, non_blocking=True)
            spec = specaug(spec)
            # mixup on log-mels
            lam = np.random.beta(cfg.aug.mixup_alpha, cfg.aug.mixup_alpha)
            perm = torch.randperm(spec.size(0), device=device)
            spec = lam * spec + (1 - lam) * spec[perm]
            logits = model(spec)
            loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.item()
            step += 1
            if rank == 0 and step % cfg.log_every == 0:
                writer.add_scalar("train/loss", running / cfg.log_every, step)
                running = 0.0

        acc, macc = evaluate(model, val_loader, device, num_classes)
        if rank == 0:
            log.info("epoch %d  val acc %.4f  mean-class acc %.4f", epoch, acc, macc)
            writer.add_scalar("val/acc", acc, epoch)
            writer.add_scalar("val/mean_class_acc", macc, epoch)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "classes": full.classes, "epoch": epoch,
                            "cfg": OmegaConf.to_container(cfg)}, os.path.join(out_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        log.info("best val acc %.4f", best)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
