"""Character CTC acoustic model (conv front-end + BiGRU) on LibriSpeech, DDP + AMP.

Greedy-decoding WER on dev-clean after every epoch selects the checkpoint; the
LR is reduced when WER plateaus and training stops after --patience bad epochs.

    torchrun --nproc_per_node=8 13_librispeech_ctc_wer.py --root /data/librispeech
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


def edit_distance(a, b):
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


class Featurizer:
    def __init__(self, train):
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)
        self.aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(27),
                                 torchaudio.transforms.TimeMasking(40)) if train else None

    def __call__(self, wav):
        feats = (self.mel(wav) + 1e-6).log().squeeze(0)  # (80, T)
        feats = (feats - feats.mean(1, keepdim=True)) / (feats.std(1, keepdim=True) + 1e-5)
        if self.aug is not None:
            feats = self.aug(feats)
        return feats.t()


def make_collate(featurizer):
    def collate(batch):
        feats, targets = [], []
        for wav, _, transcript, *_ in batch:
            feats.append(featurizer(wav))
            targets.append(torch.tensor([CHAR2ID[c] for c in transcript.lower() if c in CHAR2ID]))
        feat_lens = torch.tensor([f.shape[0] for f in feats])
        tgt_lens = torch.tensor([len(t) for t in targets])
        return pad_sequence(feats, batch_first=True), feat_lens, torch.cat(targets), tgt_lens, \
            [b[2].lower() for b in batch]
    return collate


class CTCModel(nn.Module):
    def __init__(self, n_mels=80, hidden=512, layers=4):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(n_mels, hidden, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv1d(hidden, hidden, 5, stride=1, padding=2), nn.GELU(),
        )
        self.rnn = nn.GRU(hidden, hidden, num_layers=layers, bidirectional=True, batch_first=True, dropout=0.1)
        self.proj = nn.Linear(2 * hidden, len(VOCAB))

    def forward(self, x, lens):
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        lens = (lens + 1) // 2
        x, _ = self.rnn(x)
        return self.proj(x), lens


def greedy_decode(log_probs, lens):
    out = []
    for lp, n in zip(log_probs.argmax(-1), lens):
        ids = torch.unique_consecutive(lp[:n]).tolist()
        out.append("".join(VOCAB[i] for i in ids if i != 0))
    return out


@torch.no_grad()
def word_error_rate(model, loader, device):
    model.eval()
    errs = torch.zeros(2, device=device, dtype=torch.float64)
    for feats, feat_lens, _, _, texts in loader:
        logits, out_lens = model(feats.to(device), feat_lens.to(device))
        for hyp, ref in zip(greedy_decode(logits.float(), out_lens), texts):
            errs[0] += edit_distance(hyp.split(), ref.split())
            errs[1] += len(ref.split())
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--ckpt-dir", default="ckpt/ctc_bigru")
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--patience", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = torch.utils.data.ConcatDataset([
        torchaudio.datasets.LIBRISPEECH(args.root, url=u) for u in
        ("train-clean-100", "train-clean-360", "train-other-500")])
    dev_set = torchaudio.datasets.LIBRISPEECH(args.root, url="dev-clean")

    sampler = DistributedSampler(train_set, shuffle=True, seed=1)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                              collate_fn=make_collate(Featurizer(train=True)), pin_memory=True, drop_last=True)
    dev_loader = DataLoader(Subset(dev_set, range(rank, len(dev_set), world)), batch_size=32, num_workers=4,
                            collate_fn=make_collate(Featurizer(train=False)))

    model = DDP(CTCModel().to(device), device_ids=[local_rank])
    ctc = nn.CTCLoss(blank=0, zero_infinity=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=2)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best_wer, bad_epochs = float("inf"), 0

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, n_skipped = time.time(), 0
        for step, (feats, feat_lens, targets, tgt_lens, _) in enumerate(train_loader):
            feats, feat_lens = feats.to(device, non_blocking=True), feat_lens.to(device)
            targets, tgt_lens = targets.to(device), tgt_lens.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, out_lens = model(feats, feat_lens)
            log_probs = logits.float().log_softmax(-1).transpose(0, 1)  # (T, B, V)
            loss = ctc(log_probs, targets, out_lens, tgt_lens)
            if not torch.isfinite(loss):
                n_skipped += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} ctc {loss.item():.3f} scale {scaler.get_scale():.0f}",
                      flush=True)

        wer = word_error_rate(model.module, dev_loader, device)
        plateau.step(wer)
        if rank == 0:
            print(f"epoch {epoch} dev-clean WER {wer:.4f} lr {optimizer.param_groups[0]['lr']:.2e} "
                  f"skipped {n_skipped} ({time.time() - t0:.0f}s)", flush=True)
        if wer < best_wer:
            best_wer, bad_epochs = wer, 0
            if rank == 0:
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "wer": wer,
                            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                           os.path.join(args.ckpt_dir, "best.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                if rank == 0:
                    print(f"early stopping; best dev WER {best_wer:.4f}")
                break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
