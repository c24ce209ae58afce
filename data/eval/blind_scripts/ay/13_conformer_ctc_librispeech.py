"""Conformer-CTC (char vocabulary) on LibriSpeech 960h.

GPU feature extraction (log-mel + SpecAugment on device), bf16 autocast, fused AdamW, Noam schedule.

    torchrun --nproc_per_node=8 13_conformer_ctc_librispeech.py --root /datasets/librispeech --out /shared/asr/conf_ctc
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


def encode(text):
    return [CHAR2ID[c] for c in text.lower() if c in CHAR2ID]


def collate(batch):
    wavs = [b[0].squeeze(0) for b in batch]
    texts = [torch.tensor(encode(b[2]), dtype=torch.long) for b in batch]
    wav_lens = torch.tensor([w.numel() for w in wavs])
    tgt_lens = torch.tensor([t.numel() for t in texts])
    return (nn.utils.rnn.pad_sequence(wavs, batch_first=True), wav_lens,
            nn.utils.rnn.pad_sequence(texts, batch_first=True), tgt_lens)


class ConformerCTC(nn.Module):
    def __init__(self, n_mels=80, d=512, heads=8, ffn=2048, layers=16, kernel=31, vocab=len(VOCAB)):
        super().__init__()
        self.subsample = nn.Sequential(
            nn.Conv2d(1, d, 3, stride=2), nn.SiLU(),
            nn.Conv2d(d, d, 3, stride=2), nn.SiLU(),
        )
        self.proj = nn.Linear(d * (((n_mels - 1) // 2 - 1) // 2), d)
        self.encoder = torchaudio.models.Conformer(input_dim=d, num_heads=heads, ffn_dim=ffn,
                                                   num_layers=layers, depthwise_conv_kernel_size=kernel,
                                                   dropout=0.1)
        self.head = nn.Linear(d, vocab)

    def forward(self, feats, lens):
        x = self.subsample(feats.unsqueeze(1))  # B, d, T', F'
        B, C, T, Fq = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(B, T, C * Fq))
        lens = ((lens - 1) // 2 - 1) // 2
        lens = lens.clamp(max=T)
        x, lens = self.encoder(x, lens)
        return self.head(x), lens


def greedy_decode(log_probs, lens):
    out = []
    for lp, n in zip(log_probs, lens):
        ids = lp[:n].argmax(-1).tolist()
        prev, s = 0, []
        for i in ids:
            if i != prev and i != 0:
                s.append(VOCAB[i])
            prev = i
        out.append("".join(s))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--peak-lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    train_ds = ConcatDataset([torchaudio.datasets.LIBRISPEECH(args.root, url=u) for u in
                              ("train-clean-100", "train-clean-360", "train-other-500")])
    dev_ds = torchaudio.datasets.LIBRISPEECH(args.root, url="dev-clean")
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True, persistent_workers=True)
    dev_shard = Subset(dev_ds, range(rank, len(dev_ds), world))
    dev_dl = DataLoader(dev_shard, batch_size=args.bs, collate_fn=collate, num_workers=4, pin_memory=True)

    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                               n_mels=80).to(dev)
    specaug = nn.Sequential(torchaudio.transforms.FrequencyMasking(27),
                            torchaudio.transforms.FrequencyMasking(27),
                            torchaudio.transforms.TimeMasking(100, p=0.05)).to(dev)

    def featurize(wav, wav_lens, train):
        with torch.no_grad():
            f = (mel(wav) + 1e-6).log().transpose(1, 2)  # B, T, 80
            f = (f - f.mean(dim=1, keepdim=True)) / (f.std(dim=1, keepdim=True) + 1e-5)
            if train:
                f = specaug(f.transpose(1, 2)).transpose(1, 2)
        return f, wav_lens // 160 + 1

    model = ConformerCTC().to(dev)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3, fused=True)
    noam = lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, noam)
    ctc = nn.CTCLoss(blank=0, reduction="mean")

    start_epoch = 0
    ck_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = sched.last_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.perf_counter()
        for wav, wav_lens, tgt, tgt_lens in train_dl:
            wav, tgt = wav.to(dev, non_blocking=True), tgt.to(dev, non_blocking=True)
            feats, feat_lens = featurize(wav, wav_lens.to(dev), train=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, out_lens = ddp(feats, feat_lens)
            log_probs = F.log_softmax(logits.float(), dim=-1).transpose(0, 1)
            loss = ctc(log_probs, tgt, out_lens, tgt_lens.to(dev))
            if not torch.isfinite(loss):
                if rank == 0:
                    print(f"step {step}: non-finite CTC loss, skipping batch", flush=True)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.perf_counter() - t0) / 100
                    audio_sec = wav_lens.sum().item() / 16000 * world
                    print(f"ep {epoch} step {step} ctc {l.item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{dt * 1e3:.0f} ms/step ~{audio_sec / dt:.0f} audio-s/s", flush=True)
                t0 = time.perf_counter()

        # dev-clean CER
        model.eval()
        errs = torch.zeros(2, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for wav, wav_lens, tgt, tgt_lens in dev_dl:
                feats, feat_lens = featurize(wav.to(dev), wav_lens.to(dev), train=False)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, out_lens = model(feats, feat_lens)
                hyps = greedy_decode(logits.float(), out_lens.tolist())
                for h, t, n in zip(hyps, tgt, tgt_lens.tolist()):
                    ref = "".join(VOCAB[i] for i in t[:n].tolist())
                    errs[0] += torchaudio.functional.edit_distance(ref, h)
                    errs[1] += len(ref)
        dist.all_reduce(errs)
        if rank == 0:
            print(f"epoch {epoch}: dev-clean CER {100 * errs[0].item() / errs[1].item():.2f}%", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ck_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
