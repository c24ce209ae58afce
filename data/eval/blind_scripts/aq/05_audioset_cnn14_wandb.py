"""CNN14-style audio tagging on AudioSet (PANNs-style packed HDF5 waveforms).

torchrun --nproc_per_node=8 05_audioset_cnn14_wandb.py \
    --train_h5 /data/audioset/balanced_train.h5 --eval_h5 /data/audioset/eval.h5
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import wandb
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES = 527


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_h5", required=True)
    parser.add_argument("--eval_h5", required=True)
    parser.add_argument("--workspace", default="workspace/cnn14")
    parser.add_argument("--batch_size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--mixup_alpha", type=float, default=1.0)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--wandb_project", default="audioset-tagging")
    parser.add_argument("--run_name", default=None)
    return parser.parse_args()


class AudioSetH5(Dataset):
    def __init__(self, path, clip_samples=320000):
        self.path = path
        self.clip_samples = clip_samples
        with h5py.File(path, "r") as hf:
            self.length = len(hf["audio_name"])
        self.hf = None

    def __len__(self):
        return self.length

    def __getitem__(self, idx):
        if self.hf is None:
            self.hf = h5py.File(self.path, "r")
        wav = self.hf["waveform"][idx].astype(np.float32) / 32768.0
        target = self.hf["target"][idx].astype(np.float32)
        wav = wav[: self.clip_samples]
        if len(wav) < self.clip_samples:
            wav = np.pad(wav, (0, self.clip_samples - len(wav)))
        return torch.from_numpy(wav), torch.from_numpy(target)


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x, pool=(2, 2)):
        x = F.relu_(self.bn1(self.conv1(x)))
        x = F.relu_(self.bn2(self.conv2(x)))
        return F.avg_pool2d(x, pool)


class Cnn14(nn.Module):
    def __init__(self, sample_rate=32000, n_mels=64, classes=NUM_CLASSES):
        super().__init__()
        self.melspec = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=1024, hop_length=320,
                                                            f_min=50, f_max=14000, n_mels=n_mels)
        self.to_db = torchaudio.transforms.AmplitudeToDB(top_db=None)
        self.spec_aug = nn.Sequential(torchaudio.transforms.TimeMasking(64), torchaudio.transforms.FrequencyMasking(8))
        self.bn0 = nn.BatchNorm2d(n_mels)
        chans = [1, 64, 128, 256, 512, 1024, 2048]
        self.blocks = nn.ModuleList([ConvBlock(chans[i], chans[i + 1]) for i in range(6)])
        self.fc1 = nn.Linear(2048, 2048)
        self.fc_out = nn.Linear(2048, classes)

    def forward(self, wav, mix_lambda=None, mix_index=None):
        x = self.to_db(self.melspec(wav)).unsqueeze(1)  # B,1,M,T
        x = self.bn0(x.transpose(1, 2)).transpose(1, 2)
        if self.training:
            x = self.spec_aug(x)
            if mix_lambda is not None:
                x = mix_lambda.view(-1, 1, 1, 1) * x + (1 - mix_lambda.view(-1, 1, 1, 1)) * x[mix_index]
        for i, blk in enumerate(self.blocks):
            x = blk(x, pool=(2, 2) if i < 5 else (1, 1))
            x = F.dropout(x, 0.2, self.training)
        x = x.mean(dim=2)
        x = x.max(dim=2)[0] + x.mean(dim=2)
        x = F.dropout(F.relu_(self.fc1(F.dropout(x, 0.5, self.training))), 0.5, self.training)
        return self.fc_out(x)


def gather_predictions(preds, targets, n_total, world_size):
    """all_gather equal-sized shards and undo DistributedSampler's interleaving + padding."""
    pg = [torch.empty_like(preds) for _ in range(world_size)]
    tg = [torch.empty_like(targets) for _ in range(world_size)]
    dist.all_gather(pg, preds)
    dist.all_gather(tg, targets)
    preds = torch.stack(pg, dim=1).reshape(-1, preds.size(-1))[:n_total]
    targets = torch.stack(tg, dim=1).reshape(-1, targets.size(-1))[:n_total]
    return preds.cpu().numpy(), targets.cpu().numpy()


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    preds, targets = [], []
    for wav, target in loader:
        preds.append(torch.sigmoid(model(wav.to(device, non_blocking=True))))
        targets.append(target.to(device))
    preds, targets = gather_predictions(torch.cat(preds), torch.cat(targets), len(loader.dataset), world_size)
    model.train()
    keep = targets.sum(0) > 0
    return float(np.mean(average_precision_score(targets[:, keep], preds[:, keep], average=None)))


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    train_set = AudioSetH5(args.train_h5)
    eval_set = AudioSetH5(args.eval_h5)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    eval_sampler = DistributedSampler(eval_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.num_workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(eval_set, args.batch_size, sampler=eval_sampler, num_workers=4, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Cnn14()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, amsgrad=True)
    beta = torch.distributions.Beta(args.mixup_alpha, args.mixup_alpha)

    if rank == 0:
        os.makedirs(args.workspace, exist_ok=True)
    best_map, global_step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for wav, target in train_loader:
            wav, target = wav.to(device, non_blocking=True), target.to(device, non_blocking=True)
            lam = beta.sample((wav.size(0),)).to(device)
            perm = torch.randperm(wav.size(0), device=device)
            logits = model(wav, lam, perm)
            mixed_target = lam[:, None] * target + (1 - lam[:, None]) * target[perm]
            loss = F.binary_cross_entropy_with_logits(logits, mixed_target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            if global_step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "epoch": epoch}, step=global_step)

        mAP = evaluate(model, eval_loader, device, world_size)
        wandb.log({"eval/mAP": mAP, "epoch_time": time.time() - t0}, step=global_step)
        if rank == 0:
            print(f"epoch {epoch} eval mAP {mAP:.4f} ({time.time() - t0:.0f}s)")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "mAP": mAP}
            torch.save(state, os.path.join(args.workspace, "last.pth"))
            if mAP > best_map:
                best_map = mAP
                torch.save(state, os.path.join(args.workspace, "best.pth"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
