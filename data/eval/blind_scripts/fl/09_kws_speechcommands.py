"""Keyword spotting on Google Speech Commands v2 (35 words) with a small
depthwise-separable CNN, trained with DeepSpeed ZeRO-2 + fp16 under torchrun.

    torchrun --nnodes 1 --nproc_per_node 4 09_kws_speechcommands.py --root /data/speech_commands
"""
import argparse
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SAMPLE_RATE = 16000


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--logdir", default="runs/kws")
    parser.add_argument("--ckpt", default="checkpoints/kws")
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args()


class SpeechCommands(torchaudio.datasets.SPEECHCOMMANDS):
    def __init__(self, root, subset, labels):
        super().__init__(root, download=False, subset=subset)
        self.label_to_idx = {l: i for i, l in enumerate(labels)}

    def __getitem__(self, n):
        wav, sr, label, *_ = super().__getitem__(n)
        wav = wav[0]
        if wav.numel() < SAMPLE_RATE:
            wav = F.pad(wav, (0, SAMPLE_RATE - wav.numel()))
        return wav[:SAMPLE_RATE], self.label_to_idx[label]


class DSConvBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False)
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(self.bn1(self.dw(x)))
        return F.relu(self.bn2(self.pw(x)))


class KWSNet(nn.Module):
    def __init__(self, n_classes, width=172):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, (10, 4), stride=(2, 2), padding=(5, 1), bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[DSConvBlock(width, width) for _ in range(5)])
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(width, n_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x.unsqueeze(1)))
        return self.fc(self.dropout(x.mean(dim=(2, 3))))


class LogMel(nn.Module):
    """Feature extraction on the GPU, kept outside the DeepSpeed-managed model (fp32)."""

    def __init__(self):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=480, hop_length=160, n_mels=40)
        self.freq_mask = torchaudio.transforms.FrequencyMasking(7)
        self.time_mask = torchaudio.transforms.TimeMasking(20)

    def forward(self, wav, augment):
        x = (self.mel(wav) + 1e-6).log()
        if augment:
            x = self.time_mask(self.freq_mask(x))
        return x


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    labels = sorted(d for d in os.listdir(os.path.join(args.root, "SpeechCommands", "speech_commands_v0.02"))
                    if os.path.isdir(os.path.join(args.root, "SpeechCommands", "speech_commands_v0.02", d))
                    and not d.startswith("_"))
    train_set = SpeechCommands(args.root, "training", labels)
    val_set = SpeechCommands(args.root, "validation", labels)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    # eval shards without padding so every clip is counted exactly once
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=256, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = KWSNet(len(labels))
    total_steps = len(train_loader) * args.epochs
    ds_config = {
        "train_batch_size": args.batch_size * world_size,
        "train_micro_batch_size_per_gpu": args.batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 1e-3}},
        "scheduler": {"type": "OneCycle",
                      "params": {"cycle_min_lr": args.lr / 25, "cycle_max_lr": args.lr,
                                 "cycle_first_step_size": total_steps // 10,
                                 "cycle_second_step_size": total_steps - total_steps // 10,
                                 "decay_step_size": 0, "cycle_momentum": False}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    featurizer = LogMel().to(device)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    start_epoch = 0
    if args.resume:
        _, client_state = engine.load_checkpoint(args.ckpt)
        if client_state is not None:
            start_epoch = client_state["epoch"] + 1

    best_acc = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        for step, (wav, target) in enumerate(train_loader):
            wav, target = wav.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.no_grad():
                feats = featurizer(wav, augment=True)
            logits = engine(feats.half())
            loss = F.cross_entropy(logits.float(), target, label_smoothing=0.1)
            engine.backward(loss)
            engine.step()
            if writer is not None and engine.global_steps % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), engine.global_steps)
                writer.add_scalar("train/lr", engine.get_lr()[0], engine.global_steps)

        engine.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for wav, target in val_loader:
                wav, target = wav.to(device), target.to(device)
                pred = engine(featurizer(wav, augment=False).half()).argmax(-1)
                correct[0] += (pred == target).sum()
                correct[1] += target.numel()
        dist.all_reduce(correct, op=dist.ReduceOp.SUM)
        acc = (correct[0] / correct[1]).item()

        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): val acc {acc * 100:.2f}%", flush=True)
            writer.add_scalar("val/acc", acc, epoch)

        engine.save_checkpoint(args.ckpt, tag=f"ep{epoch:03d}", client_state={"epoch": epoch})
        if acc > best_acc:
            best_acc = acc
            if rank == 0:
                torch.save({"model": {k: v.float().cpu() for k, v in engine.module.state_dict().items()},
                            "labels": labels}, os.path.join(args.ckpt, "kws_best.pt"))

    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
