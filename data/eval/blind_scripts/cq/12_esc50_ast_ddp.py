"""ESC-50 fine-tuning of the AudioSet-pretrained AST (YuanGongND/ast ASTModel), DDP version.

    torchrun --nproc_per_node=4 12_esc50_ast_ddp.py --data_dir /data/ESC-50-master --fold 1 \
        --exp_dir exp/ast_esc50_f1
"""
import argparse
import os
import pickle
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from src.models import ASTModel

TARGET_LEN = 512           # 5 s at 10 ms hop
NORM = (-6.6268077, 5.358466)   # ESC-50 fbank statistics from the AST recipe


def parse_args():
    parser = argparse.ArgumentParser(description="AST ESC-50")
    parser.add_argument("--data_dir", type=str, required=True)
    parser.add_argument("--fold", type=int, default=1)
    parser.add_argument("--exp_dir", type=str, default="exp/ast_esc50")
    parser.add_argument("--n_epochs", type=int, default=25)
    parser.add_argument("--batch_size", type=int, default=12, help="per process")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--freqm", type=int, default=24)
    parser.add_argument("--timem", type=int, default=96)
    parser.add_argument("--mixup", type=float, default=0.0)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class ESCWave(Dataset):
    def __init__(self, data_dir, folds):
        meta = pd.read_csv(os.path.join(data_dir, "meta", "esc50.csv"))
        meta = meta[meta.fold.isin(folds)]
        self.files = [os.path.join(data_dir, "audio_16k", f) for f in meta.filename]
        self.targets = meta.target.to_numpy()

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        wav, sr = torchaudio.load(self.files[idx])
        assert sr == 16000
        return wav[0] - wav[0].mean(), int(self.targets[idx])


class Fbank(nn.Module):
    def __init__(self, freqm, timem):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                                        n_mels=128, f_min=20, f_max=8000)
        self.freqm = torchaudio.transforms.FrequencyMasking(freqm) if freqm else nn.Identity()
        self.timem = torchaudio.transforms.TimeMasking(timem) if timem else nn.Identity()

    @torch.no_grad()
    def forward(self, wav, train):
        x = torch.log(self.mel(wav) + 1e-6)                    # B, 128, T
        x = F.pad(x, (0, max(0, TARGET_LEN - x.shape[-1])))[..., :TARGET_LEN]
        if train:
            x = self.timem(self.freqm(x))
        x = (x - NORM[0]) / (NORM[1] * 2)
        return x.transpose(1, 2)                                # B, T, 128


def validate(model, fbank, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    loss_sum = torch.zeros(1, device=device)
    with torch.no_grad():
        for wav, y in loader:
            wav, y = wav.to(device), y.to(device)
            out = model(fbank(wav, train=False))
            loss_sum += F.cross_entropy(out, y, reduction="sum")
            correct += (out.argmax(1) == y).sum()
            total += y.numel()
    for t in (correct, total, loss_sum):
        dist.all_reduce(t)
    return (correct / total).item(), (loss_sum / total).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_ds = ESCWave(args.data_dir, [f for f in range(1, 6) if f != args.fold])
    val_ds = ESCWave(args.data_dir, [args.fold])
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = torch.utils.data.SubsetRandomSampler(list(range(rank, len(val_ds), world)))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=48, sampler=val_sampler, num_workers=args.num_workers)

    ast = ASTModel(label_dim=50, fstride=10, tstride=10, input_fdim=128, input_tdim=TARGET_LEN,
                   imagenet_pretrain=True, audioset_pretrain=True, model_size="base384")
    ast = ast.to(device)
    model = DDP(ast, device_ids=[args.local_rank], output_device=args.local_rank)
    fbank = Fbank(args.freqm, args.timem).to(device)

    # AST recipe: new head gets 10x lr (it is model.mlp_head inside ASTModel)
    head = [p for n, p in model.module.named_parameters() if "mlp_head" in n]
    body = [p for n, p in model.module.named_parameters() if "mlp_head" not in n]
    lr = args.lr * world * args.batch_size / 48
    optimizer = torch.optim.Adam([{"params": body, "lr": lr}, {"params": head, "lr": lr * 10}],
                                 weight_decay=5e-7, betas=(0.95, 0.999))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(range(5, 26)), gamma=0.85)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(os.path.join(args.exp_dir, "models"), exist_ok=True)
        with open(os.path.join(args.exp_dir, "args.pkl"), "wb") as f:
            pickle.dump(args, f)

    best_acc, history = 0.0, []
    for epoch in range(1, args.n_epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        epoch_loss = torch.zeros(1, device=device)
        for i, (wav, y) in enumerate(train_loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = fbank(wav, train=True)
            tgt = F.one_hot(y, 50).float()
            if args.mixup > 0 and np.random.rand() < args.mixup:
                lam = np.random.beta(10, 10)
                perm = torch.randperm(x.size(0), device=device)
                x = lam * x + (1 - lam) * x[perm]
                tgt = lam * tgt + (1 - lam) * tgt[perm]
            with torch.autocast("cuda"):
                out = model(x)
            loss = F.cross_entropy(out.float(), tgt)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += loss.detach()
        scheduler.step()
        dist.all_reduce(epoch_loss)
        epoch_loss /= world * len(train_loader)

        acc, val_loss = validate(model.module, fbank, val_loader, device)
        history.append((epoch, epoch_loss.item(), val_loss, acc))
        if rank == 0:
            print(f"epoch {epoch}: train_loss {epoch_loss.item():.4f} val_loss {val_loss:.4f} acc {acc:.4f} "
                  f"time {time.time() - t0:.1f}s", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.exp_dir, "models", f"audio_model.{epoch}.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(args.exp_dir, "models", "best_audio_model.pth"))
            np.savetxt(os.path.join(args.exp_dir, "result.csv"), np.array(history), delimiter=",")

    if rank == 0:
        print(f"fold {args.fold} best acc {best_acc:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
