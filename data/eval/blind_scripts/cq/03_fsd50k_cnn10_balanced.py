"""FSD50K multi-label tagging with a PANNs-style Cnn10, class-balanced sampling.

    torchrun --standalone --nproc_per_node=8 03_fsd50k_cnn10_balanced.py --root /datasets/FSD50K
"""
import argparse
import logging
import os
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, WeightedRandomSampler
from torchaudio.transforms import AmplitudeToDB, FrequencyMasking, MelSpectrogram, TimeMasking


@dataclass
class Config:
    root: str = "/datasets/FSD50K"
    out_dir: str = "checkpoints/fsd50k_cnn10"
    sample_rate: int = 32000
    clip_seconds: float = 10.0
    n_mels: int = 64
    batch_size: int = 32          # per GPU
    lr: float = 1e-3
    epochs: int = 40
    mixup_alpha: float = 1.0
    num_workers: int = 8
    seed: int = 42


class FSD50K(Dataset):
    def __init__(self, cfg, split):
        vocab = pd.read_csv(os.path.join(cfg.root, "FSD50K.ground_truth", "vocabulary.csv"),
                            header=None, names=["idx", "label", "mid"])
        self.lab2idx = {l: int(i) for i, l in zip(vocab["idx"], vocab["label"])}
        if split == "eval":
            meta = pd.read_csv(os.path.join(cfg.root, "FSD50K.ground_truth", "eval.csv"))
            audio_dir = os.path.join(cfg.root, "FSD50K.eval_audio")
        else:
            meta = pd.read_csv(os.path.join(cfg.root, "FSD50K.ground_truth", "dev.csv"))
            meta = meta[meta["split"] == split].reset_index(drop=True)
            audio_dir = os.path.join(cfg.root, "FSD50K.dev_audio")
        self.paths = [os.path.join(audio_dir, f"{fname}.wav") for fname in meta["fname"]]
        self.targets = np.zeros((len(meta), len(self.lab2idx)), dtype=np.float32)
        for r, labels in enumerate(meta["labels"]):
            for l in labels.split(","):
                self.targets[r, self.lab2idx[l]] = 1.0
        self.n = int(cfg.sample_rate * cfg.clip_seconds)
        self.random_crop = split == "train"

    def __len__(self):
        return len(self.paths)

    def sample_weights(self):
        counts = self.targets.sum(0) + 1.0
        return (self.targets / counts).sum(1)

    def __getitem__(self, i):
        wav, _ = sf.read(self.paths[i], dtype="float32")
        if len(wav) >= self.n:
            start = np.random.randint(0, len(wav) - self.n + 1) if self.random_crop else 0
            wav = wav[start:start + self.n]
        else:
            wav = np.pad(wav, (0, self.n - len(wav)))
        return torch.from_numpy(wav), torch.from_numpy(self.targets[i])


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        )

    def forward(self, x):
        return F.avg_pool2d(self.net(x), 2)


class Cnn10(nn.Module):
    def __init__(self, n_mels, n_classes):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(n_mels)
        self.blocks = nn.Sequential(ConvBlock(1, 64), ConvBlock(64, 128), ConvBlock(128, 256), ConvBlock(256, 512))
        self.fc1 = nn.Linear(512, 512)
        self.fc_out = nn.Linear(512, n_classes)

    def forward(self, x):                     # x: (B, 1, T, M)
        x = self.bn0(x.transpose(1, 3)).transpose(1, 3)
        x = F.dropout(self.blocks(x), 0.2, self.training).mean(3)
        x = x.max(2)[0] + x.mean(2)
        x = F.relu(self.fc1(F.dropout(x, 0.5, self.training)))
        return self.fc_out(F.dropout(x, 0.5, self.training))


class GpuFrontend(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.melspec = MelSpectrogram(cfg.sample_rate, n_fft=1024, hop_length=320, n_mels=cfg.n_mels,
                                      f_min=50, f_max=14000)
        self.to_db = AmplitudeToDB(top_db=80)
        self.masks = nn.Sequential(FrequencyMasking(16), TimeMasking(100))

    @torch.no_grad()
    def forward(self, wav, augment):
        x = self.to_db(self.melspec(wav))
        if augment:
            x = self.masks(x)
        return x.transpose(1, 2).unsqueeze(1)


class ShardSampler(Sampler):
    """Every rank gets indices rank, rank + world, ... (no padding, so no duplicated clips)."""

    def __init__(self, n, rank, world):
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def gather_numpy(arr):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, arr)
    return np.concatenate(out, axis=0)


@torch.no_grad()
def evaluate(model, frontend, loader, device):
    model.eval()
    ps, ts = [], []
    for wav, y in loader:
        logits = model(frontend(wav.to(device, non_blocking=True), augment=False))
        ps.append(torch.sigmoid(logits).cpu().numpy())
        ts.append(y.numpy())
    p, t = gather_numpy(np.concatenate(ps)), gather_numpy(np.concatenate(ts))
    keep = t.sum(0) > 0
    return float(average_precision_score(t[:, keep], p[:, keep], average="macro"))


def main():
    parser = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        parser.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    cfg = Config(**vars(parser.parse_args()))

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed + rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")
    log = logging.getLogger(__name__)

    train_set, val_set = FSD50K(cfg, "train"), FSD50K(cfg, "val")
    n_classes = train_set.targets.shape[1]
    sampler = WeightedRandomSampler(torch.as_tensor(train_set.sample_weights(), dtype=torch.double),
                                    num_samples=len(train_set), replacement=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=ShardSampler(len(val_set), rank, world),
                            num_workers=cfg.num_workers)

    model = Cnn10(cfg.n_mels, n_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    frontend = GpuFrontend(cfg).to(device)

    lr = cfg.lr * world * cfg.batch_size / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), amsgrad=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * len(train_loader))
    beta = torch.distributions.Beta(cfg.mixup_alpha, cfg.mixup_alpha)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(cfg.epochs):
        model.train()
        tot, n = torch.zeros((), device=device), 0
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = frontend(wav, augment=True)
            lam = beta.sample().item()
            idx = torch.randperm(x.size(0), device=device)
            x = lam * x + (1 - lam) * x[idx]
            y = lam * y + (1 - lam) * y[idx]
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            tot += loss.detach()
            n += 1
        dist.all_reduce(tot)
        train_loss = tot.item() / (n * world)

        val_map = evaluate(model.module, frontend, val_loader, device)
        log.info("epoch %03d  loss %.4f  val mAP %.4f", epoch, train_loss, val_map)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "val_map": val_map, "config": asdict(cfg)}
            torch.save(state, os.path.join(cfg.out_dir, "last.pth"))
            if val_map > best:
                torch.save(state, os.path.join(cfg.out_dir, "best.pth"))
        best = max(best, val_map)
        dist.barrier()

    eval_set = FSD50K(cfg, "eval")
    eval_loader = DataLoader(eval_set, batch_size=64, sampler=ShardSampler(len(eval_set), rank, world),
                             num_workers=cfg.num_workers)
    ckpt = torch.load(os.path.join(cfg.out_dir, "best.pth"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    eval_map = evaluate(model.module, frontend, eval_loader, device)
    log.info("best val mAP %.4f, eval mAP %.4f", best, eval_map)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
