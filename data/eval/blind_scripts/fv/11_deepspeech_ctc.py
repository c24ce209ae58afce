"""DeepSpeech2-style CTC acoustic model on LibriSpeech manifests.

Ported from a Horovod/apex setup to torch DDP (torchrun). Manifests are CSV
lines "wav_path,transcript_path".
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LABELS = "_'ABCDEFGHIJKLMNOPQRSTUVWXYZ "  # index 0 is the CTC blank


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--val-manifest", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rnn-layers", type=int, default=5)
    p.add_argument("--max-norm", type=float, default=400.0)
    p.add_argument("--save-folder", default="models/ds2")
    p.add_argument("--continue-from", default="")
    return p.parse_args()


class SpectrogramDataset(Dataset):
    def __init__(self, manifest):
        with open(manifest) as f:
            self.items = [line.strip().split(",") for line in f if line.strip()]
        self.char2idx = {c: i for i, c in enumerate(LABELS)}
        self.spec = torchaudio.transforms.Spectrogram(n_fft=320, hop_length=160, win_length=320)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        wav_path, txt_path = self.items[i]
        wav, _ = torchaudio.load(wav_path)
        spect = torch.log1p(self.spec(wav.mean(0)))
        spect = (spect - spect.mean()) / (spect.std() + 1e-5)
        with open(txt_path) as f:
            text = f.read().strip().upper()
        target = [self.char2idx[c] for c in text if c in self.char2idx]
        return spect, torch.tensor(target, dtype=torch.long)


def collate(batch):
    batch = sorted(batch, key=lambda b: b[0].size(1), reverse=True)
    freq, max_t = batch[0][0].size(0), batch[0][0].size(1)
    inputs = torch.zeros(len(batch), 1, freq, max_t)
    input_lengths = torch.tensor([b[0].size(1) for b in batch], dtype=torch.int)
    for i, (s, _) in enumerate(batch):
        inputs[i, 0, :, :s.size(1)] = s
    targets = torch.cat([b[1] for b in batch])
    target_lengths = torch.tensor([len(b[1]) for b in batch], dtype=torch.int)
    return inputs, targets, input_lengths, target_lengths


class DeepSpeech(nn.Module):
    def __init__(self, hidden, layers, n_classes, freq=161):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, (41, 11), stride=(2, 2), padding=(20, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20, inplace=True),
            nn.Conv2d(32, 32, (21, 11), stride=(2, 1), padding=(10, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20, inplace=True))
        rnn_in = 32 * (((freq + 2 * 20 - 41) // 2 + 1 + 2 * 10 - 21) // 2 + 1)
        self.rnn = nn.LSTM(rnn_in, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        self.fc = nn.Sequential(nn.LayerNorm(2 * hidden), nn.Linear(2 * hidden, n_classes, bias=False))

    def get_seq_lens(self, input_length):
        seq_len = input_length
        for m in self.conv.modules():
            if isinstance(m, nn.Conv2d):
                seq_len = (seq_len + 2 * m.padding[1] - m.dilation[1] * (m.kernel_size[1] - 1) - 1) // m.stride[1] + 1
        return seq_len.int()

    def forward(self, x, lengths):
        x = self.conv(x)                                 # B, C, F, T
        b, c, f, t = x.size()
        x = x.view(b, c * f, t).transpose(1, 2)          # B, T, C*F
        out_lens = self.get_seq_lens(lengths)
        x = nn.utils.rnn.pack_padded_sequence(x, out_lens.cpu(), batch_first=True)
        x, _ = self.rnn(x)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True)
        return self.fc(x), out_lens


def greedy_decode(log_probs, lengths):
    out = []
    for seq, n in zip(log_probs.argmax(-1), lengths):
        prev, chars = 0, []
        for idx in seq[:n].tolist():
            if idx != prev and idx != 0:
                chars.append(LABELS[idx])
            prev = idx
        out.append("".join(chars))
    return out


def char_errors(ref, hyp):
    d = list(range(len(hyp) + 1))
    for i, rc in enumerate(ref, 1):
        prev, d[0] = d[0], i
        for j, hc in enumerate(hyp, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rc != hc))
    return d[len(hyp)]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    errs = torch.zeros(2, device=device)
    for inputs, targets, input_lengths, target_lengths in loader:
        logits, out_lens = model.module(inputs.to(device), input_lengths)
        hyps = greedy_decode(logits.log_softmax(-1), out_lens)
        offset = 0
        for hyp, tl in zip(hyps, target_lengths.tolist()):
            ref = "".join(LABELS[i] for i in targets[offset:offset + tl].tolist())
            offset += tl
            errs[0] += char_errors(ref, hyp)
            errs[1] += len(ref)
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set, val_set = SpectrogramDataset(args.train_manifest), SpectrogramDataset(args.val_manifest)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=4,
                            collate_fn=collate)

    model = DeepSpeech(args.hidden, args.rnn_layers, len(LABELS))
    start_epoch = 0
    if args.continue_from:
        package = torch.load(args.continue_from, map_location="cpu")
        model.load_state_dict(package["state_dict"])
        start_epoch = package["epoch"]
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.99)
    ctc = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)

    best_cer = math.inf
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0, total = time.time(), torch.zeros(2, device=device)
        for i, (inputs, targets, input_lengths, target_lengths) in enumerate(train_loader):
            inputs = inputs.to(device, non_blocking=True)
            logits, _ = model(inputs, input_lengths)
            output_lengths = model.get_seq_lens(input_lengths)
            log_probs = logits.float().log_softmax(-1).transpose(0, 1)   # T, B, C
            loss = ctc(log_probs, targets, output_lengths, target_lengths) / inputs.size(0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {loss.item():.3f} {time.time() - t0:.0f}s")
        scheduler.step()
        dist.all_reduce(total)
        cer = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(total[0] / total[1]).item():.3f}  CER {100 * cer:.2f}")
            os.makedirs(args.save_folder, exist_ok=True)
            package = {"state_dict": model.module.state_dict(), "epoch": epoch + 1, "cer": cer}
            torch.save(package, os.path.join(args.save_folder, "last.pth"))
            if cer < best_cer:
                best_cer = cer
                torch.save(package, os.path.join(args.save_folder, "best.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
