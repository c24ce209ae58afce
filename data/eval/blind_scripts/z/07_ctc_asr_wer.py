"""
Character-level CTC ASR (conv subsampling + BiLSTM), multi-GPU with DDP.
Validation WER/CER after each epoch, hypotheses gathered from all ranks.

    python -m torch.distributed.launch --nproc_per_node=4 07_ctc_asr_wer.py \
        --train-manifest manifests/train.jsonl --dev-manifest manifests/dev.jsonl \
        --vocab vocab.txt --exp-dir exp/ctc_bilstm
"""
import argparse
import json
import os
import shutil
import time

import jiwer
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--dev-manifest", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--exp-dir", default="exp/ctc")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-duration", type=float, default=16.0)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--local_rank", "--local-rank", type=int, default=0)
    return p


class CharVocab:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            chars = [l.rstrip("\n") for l in f]
        self.itos = ["<blank>"] + chars
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def encode(self, text):
        return [self.stoi[c] for c in text if c in self.stoi]

    def decode(self, ids):
        return "".join(self.itos[i] for i in ids)


class AudioDataset(Dataset):
    def __init__(self, manifest, vocab, max_duration, train):
        self.items = []
        with open(manifest) as f:
            for line in f:
                d = json.loads(line)
                if d["duration"] <= max_duration:
                    self.items.append(d)
        self.vocab = vocab
        self.mel = torchaudio.transforms.MelSpectrogram(sample_rate=16000, n_fft=400, hop_length=160, n_mels=80)
        self.spec_aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(27),
                                      torchaudio.transforms.TimeMasking(40)) if train else None

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        d = self.items[i]
        wav, sr = torchaudio.load(d["audio_filepath"])
        if sr != 16000:
            wav = torchaudio.functional.resample(wav, sr, 16000)
        feat = (self.mel(wav[0]) + 1e-6).log()
        feat = (feat - feat.mean(dim=1, keepdim=True)) / (feat.std(dim=1, keepdim=True) + 1e-5)
        if self.spec_aug is not None:
            feat = self.spec_aug(feat)
        target = torch.tensor(self.vocab.encode(d["text"]), dtype=torch.long)
        return i, feat.t(), target


def collate(batch):
    idx, feats, targets = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats])
    tgt_lens = torch.tensor([t.size(0) for t in targets])
    return (torch.tensor(idx), pad_sequence(feats, batch_first=True), feat_lens,
            pad_sequence(targets, batch_first=True), tgt_lens)


class CTCModel(nn.Module):
    def __init__(self, n_mels, hidden, layers, vocab_size):
        super().__init__()
        self.subsample = nn.Sequential(
            nn.Conv1d(n_mels, hidden, kernel_size=3, stride=2, padding=1), nn.GELU(),
            nn.Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1), nn.GELU(),
        )
        self.norm = nn.LayerNorm(hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True,
                           bidirectional=True, dropout=0.1)
        self.proj = nn.Linear(hidden * 2, vocab_size)

    def forward(self, x, lens):
        x = self.subsample(x.transpose(1, 2)).transpose(1, 2)
        lens = ((lens - 1) // 2) // 2 + 1
        x = self.norm(x)
        x = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        x, _ = self.rnn(x)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True)
        return self.proj(x).log_softmax(-1), lens


def greedy_decode(log_probs, lens, vocab):
    best = log_probs.argmax(-1).cpu()
    out = []
    for seq, n in zip(best, lens.tolist()):
        seq = torch.unique_consecutive(seq[:n])
        out.append(vocab.decode([t for t in seq.tolist() if t != 0]))
    return out


@torch.no_grad()
def evaluate(model, loader, dataset, vocab, device, world_size):
    model.eval()
    local = []
    for idx, feats, feat_lens, _, _ in loader:
        log_probs, out_lens = model(feats.to(device), feat_lens.to(device))
        for i, h in zip(idx.tolist(), greedy_decode(log_probs, out_lens, vocab)):
            local.append((i, h))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    hyps = dict(p for part in gathered for p in part)  # drops the sampler's padded repeats
    keys = sorted(hyps)
    refs = [dataset.items[k]["text"] for k in keys]
    hyp_list = [hyps[k] for k in keys]
    wer = jiwer.wer([" ".join(r) for r in refs], [" ".join(h) for h in hyp_list])
    cer = jiwer.cer(refs, hyp_list)
    model.train()
    return wer, cer


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    vocab = CharVocab(args.vocab)
    train_set = AudioDataset(args.train_manifest, vocab, args.max_duration, train=True)
    dev_set = AudioDataset(args.dev_manifest, vocab, 1e9, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    dev_sampler = DistributedSampler(dev_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=args.batch_size, sampler=dev_sampler,
                            collate_fn=collate, num_workers=args.num_workers, pin_memory=True)

    model = CTCModel(80, args.hidden, args.layers, len(vocab.itos)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    ctc_loss = nn.CTCLoss(blank=0, zero_infinity=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.1,
                                                    total_steps=args.epochs * len(train_loader))
    os.makedirs(args.exp_dir, exist_ok=True)
    if rank == 0:
        print(f"train utts={len(train_set)} dev utts={len(dev_set)} vocab={len(vocab.itos)} world={world_size}")

    best_wer = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, tot_loss, n = time.time(), 0.0, 0
        for idx, feats, feat_lens, targets, tgt_lens in train_loader:
            feats, feat_lens = feats.to(device, non_blocking=True), feat_lens.to(device)
            targets, tgt_lens = targets.to(device, non_blocking=True), tgt_lens.to(device)
            log_probs, out_lens = model(feats, feat_lens)
            loss = ctc_loss(log_probs.transpose(0, 1), targets, out_lens, tgt_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            tot_loss += loss.item()
            n += 1
        if rank == 0:
            print(f"epoch {epoch}: train ctc {tot_loss / max(n, 1):.4f} ({time.time() - t0:.0f}s)", flush=True)

        wer, cer = evaluate(model.module, dev_loader, dev_set, vocab, device, world_size)
        if rank == 0:
            print(f"epoch {epoch}: dev WER {wer * 100:.2f} CER {cer * 100:.2f}", flush=True)

        ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "wer": wer, "vocab": vocab.itos}
        last_path = os.path.join(args.exp_dir, "last.pt")
        torch.save(ckpt, last_path)
        if wer < best_wer:
            best_wer = wer
            shutil.copyfile(last_path, os.path.join(args.exp_dir, "best.pt"))

    if rank == 0:
        print(f"best dev WER {best_wer * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
