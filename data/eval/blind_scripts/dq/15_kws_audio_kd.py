"""Keyword spotting distillation (Speech Commands v2, 35 words).

Teacher: AST-style conv-transformer we trained on log-mels (frozen).
Student: DS-CNN-S (~24k params) for the always-on DSP.
Front-end (log-mel + SpecAugment) runs on the GPU inside the training step.

torchrun --nproc_per_node=4 15_kws_audio_kd.py --root /data/speech_commands --teacher ckpt/kws_teacher.pt
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchaudio.datasets import SPEECHCOMMANDS

from kws_models import KWSTransformer  # teacher definition shared with the teacher training repo

SAMPLE_RATE = 16000
LABELS = sorted("backward bed bird cat dog down eight five follow forward four go happy house learn left "
                "marvin nine no off on one right seven sheila six stop three tree two up visual wow yes "
                "zero".split())
LABEL_TO_IDX = {w: i for i, w in enumerate(LABELS)}


class SubsetSC(SPEECHCOMMANDS):
    def __init__(self, root, subset):
        super().__init__(root, download=False)
        def load_list(name):
            with open(os.path.join(self._path, name)) as f:
                return {os.path.normpath(os.path.join(self._path, line.strip())) for line in f}
        if subset == "validation":
            self._walker = [w for w in self._walker if os.path.normpath(w) in load_list("validation_list.txt")]
        elif subset == "testing":
            self._walker = [w for w in self._walker if os.path.normpath(w) in load_list("testing_list.txt")]
        else:
            excl = load_list("validation_list.txt") | load_list("testing_list.txt")
            self._walker = [w for w in self._walker if os.path.normpath(w) not in excl]


def collate(batch):
    wavs, ys = [], []
    for wav, sr, label, *_ in batch:
        wav = wav[0]
        wav = F.pad(wav, (0, SAMPLE_RATE - wav.numel())) if wav.numel() < SAMPLE_RATE else wav[:SAMPLE_RATE]
        wavs.append(wav)
        ys.append(LABEL_TO_IDX[label])
    return torch.stack(wavs), torch.tensor(ys)


class LogMel(nn.Module):
    def __init__(self, n_mels=40, augment=False):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=480, hop_length=160, n_mels=n_mels)
        self.augment = augment
        self.fmask = torchaudio.transforms.FrequencyMasking(8)
        self.tmask = torchaudio.transforms.TimeMasking(20)

    def forward(self, wav):
        x = (self.mel(wav) + 1e-6).log().unsqueeze(1)  # B,1,M,T
        if self.augment and self.training:
            x = self.tmask(self.fmask(x))
        return x


class DSCNN(nn.Module):
    def __init__(self, num_classes, c=64):
        super().__init__()
        layers = [nn.Conv2d(1, c, (10, 4), (2, 2), (5, 1), bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        for _ in range(4):
            layers += [nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                       nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.body(x), 1).flatten(1))


@torch.no_grad()
def evaluate(model, frontend, loader, device):
    model.eval()
    frontend.eval()
    correct, total = 0, 0
    for wav, y in loader:
        wav, y = wav.to(device), y.to(device)
        pred = model(frontend(wav)).argmax(1)
        correct += (pred == y).sum().item()
        total += y.numel()
    stats = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    return 100.0 * stats[0].item() / stats[1].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW lr for a global batch of 512")
    ap.add_argument("--T", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--out", default="runs/kws_dscnn_kd")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        SPEECHCOMMANDS(args.root, download=True)
    dist.barrier()
    train_ds = SubsetSC(args.root, "training")
    val_ds = SubsetSC(args.root, "validation")
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=256, collate_fn=collate, num_workers=4)

    frontend_train = LogMel(augment=True).to(device)
    frontend_eval = LogMel(augment=False).to(device)

    teacher = KWSTransformer(num_classes=len(LABELS))
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher.to(device).eval().requires_grad_(False)

    student = DSCNN(len(LABELS)).to(device)
    student = DDP(student, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        frontend_train.train()
        t0 = time.time()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                clean = frontend_eval(wav)
                t_logits = teacher(clean)
                x = frontend_train(wav)
            s_logits = student(x)
            kd = F.kl_div(F.log_softmax(s_logits / args.T, 1), F.softmax(t_logits / args.T, 1),
                          reduction="batchmean") * args.T ** 2
            loss = args.alpha * kd + (1 - args.alpha) * F.cross_entropy(s_logits, y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        acc = evaluate(student.module, frontend_eval, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val acc {acc:.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": student.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(student.module.state_dict(), os.path.join(args.out, "best.pt"))
                dummy = torch.randn(1, 1, 40, 101, device=device)
                torch.onnx.export(student.module, dummy, os.path.join(args.out, "dscnn_kd.onnx"),
                                  opset_version=13, input_names=["logmel"], output_names=["logits"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
