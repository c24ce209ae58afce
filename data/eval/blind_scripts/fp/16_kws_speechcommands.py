"""Keyword spotting on Speech Commands v2 (35 words) with a ResNet-style CNN on log-mels.

    torchrun --standalone --nproc-per-node=4 --max-restarts=3 16_kws_speechcommands.py \
        --root /data/speech_commands --out /shared/kws/res15
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchaudio.datasets import SPEECHCOMMANDS

LABELS = sorted("backward bed bird cat dog down eight five follow forward four go happy house learn left "
                "marvin nine no off on one right seven sheila six stop three tree two up visual wow yes zero".split())
LABEL_TO_IDX = {w: i for i, w in enumerate(LABELS)}

stop_flag = False


def handle_term(signum, frame):
    global stop_flag
    stop_flag = True


def collate(batch):
    waves, targets = [], []
    for wav, sr, label, *_ in batch:
        wav = wav[0]
        wav = F.pad(wav, (0, 16000 - wav.numel())) if wav.numel() < 16000 else wav[:16000]
        waves.append(wav)
        targets.append(LABEL_TO_IDX[label])
    return torch.stack(waves), torch.tensor(targets)


class ResBlock(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.c1 = nn.Conv2d(ch, ch, 3, padding=dilation, dilation=dilation, bias=False)
        self.b1 = nn.BatchNorm2d(ch)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=dilation, dilation=dilation, bias=False)
        self.b2 = nn.BatchNorm2d(ch)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(y)))


class Res15(nn.Module):
    def __init__(self, n_classes, ch=45):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=40)
        self.stem = nn.Conv2d(1, ch, 3, padding=1, bias=False)
        self.blocks = nn.Sequential(*[ResBlock(ch, 2 ** (i // 2)) for i in range(6)])
        self.fc = nn.Linear(ch, n_classes)

    def forward(self, wav):
        x = torch.log(self.mel(wav) + 1e-6).unsqueeze(1)
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(x.mean(dim=(2, 3)))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--bs", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for the default 4-GPU run (global batch 512)")
    return p.parse_args()


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for wav, y in loader:
        wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (model(wav).argmax(1) == y).sum().item()
        total += y.numel()
    model.train()
    return correct / max(total, 1)


def main():
    args = get_args()
    signal.signal(signal.SIGTERM, handle_term)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = SPEECHCOMMANDS(args.root, subset="training", download=False)
    val_ds = SPEECHCOMMANDS(args.root, subset="validation", download=False)
    test_ds = SPEECHCOMMANDS(args.root, subset="testing", download=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=4)
    test_loader = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds, shuffle=False),
                             collate_fn=collate, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Res15(len(LABELS))).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-3, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    state_file = os.path.join(args.out, "state.pt")
    start_epoch, best_val = 0, 0.0
    if os.path.exists(state_file):
        s = torch.load(state_file, map_location="cpu")
        model.load_state_dict(s["model"])
        optimizer.load_state_dict(s["optimizer"])
        scheduler.load_state_dict(s["scheduler"])
        start_epoch, best_val = s["epoch"], s["best_val"]

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    preempted = False
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, device=device)
        interrupted = torch.zeros(1, device=device)
        for i, (wav, y) in enumerate(train_loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # time-shift augmentation
            wav = torch.roll(wav, shifts=int(torch.randint(-1600, 1600, (1,))), dims=1)
            loss = F.cross_entropy(model(wav), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
            if i % 20 == 0:
                interrupted.fill_(float(stop_flag))
                dist.all_reduce(interrupted, op=dist.ReduceOp.MAX)
                if interrupted.item():
                    break
        if interrupted.item():
            preempted = True
            if rank == 0:
                print(f"SIGTERM during epoch {epoch}; restarting it after the job comes back", flush=True)
            break
        scheduler.step()
        dist.all_reduce(loss_sum)

        val_acc = accuracy(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} train_loss {(loss_sum[0] / loss_sum[1]).item():.4f} val_acc {val_acc:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.4f}", flush=True)
            if val_acc > best_val:
                best_val = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
            tmp = state_file + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "best_val": best_val}, tmp)
            os.replace(tmp, state_file)
        dist.barrier()

    if not preempted:
        test_acc = accuracy(model, test_loader, device)
        if rank == 0:
            print(f"final test accuracy {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
