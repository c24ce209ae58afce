"""Fine-tune the AudioSet AST checkpoint (Hugging Face) on FSD50K, log-mels computed on the GPU.

    torchrun --nproc_per_node=4 09_fsd50k_ast_hf.py --fsd-root /data/FSD50K --run-name ast_fsd50k_bs48
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
import wandb
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import ASTForAudioClassification, get_cosine_schedule_with_warmup

AST_MEAN, AST_STD = -4.2677393, 4.5689974
MAX_FRAMES = 1024


class FSDClips(Dataset):
    def __init__(self, root, split, vocab, sr=16000, max_seconds=10.0):
        gt = os.path.join(root, "FSD50K.ground_truth")
        if split == "eval":
            df = pd.read_csv(os.path.join(gt, "eval.csv"))
            self.audio_dir = os.path.join(root, "FSD50K.eval_audio_16k")
        else:
            df = pd.read_csv(os.path.join(gt, "dev.csv"))
            df = df[df.split == split]
            self.audio_dir = os.path.join(root, "FSD50K.dev_audio_16k")
        self.fnames = df.fname.astype(str).tolist()
        self.labels = [[vocab[l] for l in s.split(",")] for s in df.labels]
        self.n_classes = len(vocab)
        self.max_len = int(sr * max_seconds)
        self.train = split == "train"

    def __len__(self):
        return len(self.fnames)

    def __getitem__(self, i):
        wav, _ = sf.read(os.path.join(self.audio_dir, self.fnames[i] + ".wav"), dtype="float32")
        if len(wav) > self.max_len:
            start = np.random.randint(len(wav) - self.max_len) if self.train else 0
            wav = wav[start:start + self.max_len]
        out = np.zeros(self.max_len, np.float32)
        out[: len(wav)] = wav
        y = np.zeros(self.n_classes, np.float32)
        y[self.labels[i]] = 1
        return torch.from_numpy(out), torch.from_numpy(y), i


class GpuFbank(torch.nn.Module):
    """Approximates AST's kaldi fbank (25 ms / 10 ms, 128 mel) in batch on the GPU."""

    def __init__(self):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                                        n_mels=128, f_min=20.0, f_max=8000.0)
        self.fmask = torchaudio.transforms.FrequencyMasking(24)
        self.tmask = torchaudio.transforms.TimeMasking(96)

    @torch.no_grad()
    def forward(self, wav, specaug=False):
        x = torch.log(self.mel(wav) + 1e-6)                        # B, 128, T
        x = F.pad(x, (0, max(0, MAX_FRAMES - x.size(-1))))[..., :MAX_FRAMES]
        if specaug:
            x = self.tmask(self.fmask(x))
        return ((x - AST_MEAN) / (2 * AST_STD)).transpose(1, 2)    # B, T, 128


def gather_eval(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


@torch.no_grad()
def run_eval(model, fbank, loader, device, n):
    model.eval()
    P, Y, I = [], [], []
    for wav, y, idx in loader:
        logits = model(input_values=fbank(wav.to(device))).logits
        P.append(logits.sigmoid())
        Y.append(y.to(device))
        I.append(idx.to(device))
    P, Y, I = gather_eval(torch.cat(P)), gather_eval(torch.cat(Y)), gather_eval(torch.cat(I))
    order = torch.argsort(I)
    P, Y, I = P[order], Y[order], I[order]
    first = torch.ones_like(I, dtype=torch.bool)
    first[1:] = I[1:] != I[:-1]
    P, Y = P[first].cpu().numpy(), Y[first].cpu().numpy()
    assert len(P) == n
    return float(average_precision_score(Y, P, average="macro"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsd-root", required=True)
    ap.add_argument("--pretrained", default="MIT/ast-finetuned-audioset-10-10-0.4593")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=12, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup-ratio", type=float, default=0.05)
    ap.add_argument("--mixup-prob", type=float, default=0.5)
    ap.add_argument("--out-dir", default="checkpoints/ast_fsd50k")
    ap.add_argument("--num-workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    wandb.init(project="fsd50k-ast", name=args.run_name, config=vars(args))

    vocab_df = pd.read_csv(os.path.join(args.fsd_root, "FSD50K.ground_truth", "vocabulary.csv"),
                           header=None, names=["idx", "label", "mid"])
    vocab = {l: int(i) for i, l in zip(vocab_df.idx, vocab_df.label)}
    train_ds = FSDClips(args.fsd_root, "train", vocab)
    val_ds = FSDClips(args.fsd_root, "val", vocab)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.num_workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 32, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.num_workers, pin_memory=True)

    # let rank 0 download / cache the checkpoint first
    if rank != 0:
        dist.barrier()
    model = ASTForAudioClassification.from_pretrained(args.pretrained, num_labels=len(vocab),
                                                      ignore_mismatched_sizes=True)
    if rank == 0:
        dist.barrier()
    model = DDP(model.to(device), device_ids=[local_rank])
    fbank = GpuFbank().to(device)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world / 4, weight_decay=1e-4)
    total = args.epochs * len(train_dl)
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)
    scaler = torch.cuda.amp.GradScaler()

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for wav, y, _ in train_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = fbank(wav, specaug=True)
            if np.random.rand() < args.mixup_prob:
                lam = float(np.random.beta(10, 10))
                perm = torch.randperm(x.size(0), device=device)
                x, y = lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(input_values=x).logits
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 25 == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": grad_norm.item(),
                           "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        val_map = run_eval(model, fbank, val_dl, device, len(val_ds))
        wandb.log({"val/mAP": val_map, "epoch": epoch}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: val mAP {val_map:.4f}", flush=True)
            os.makedirs(args.out_dir, exist_ok=True)
            if val_map > best:
                best = val_map
                model.module.save_pretrained(os.path.join(args.out_dir, "best"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out_dir, "last.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
