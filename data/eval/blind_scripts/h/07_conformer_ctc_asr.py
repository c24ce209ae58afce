"""
Conformer-CTC (torchaudio) on LibriSpeech 960h, BPE-1024 targets.

    torchrun --nproc_per_node=8 07_conformer_ctc_asr.py \
        --manifest-dir data/manifests --spm data/spm_bpe1024.model --exp exp/conformer_ctc_m

Batches are built by total duration (max_frames) rather than by a fixed number
of utterances, which keeps padding low and the GPU memory steady.
"""
import argparse
import json
import math
import os
import random
import time

import editdistance
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


class ManifestDataset(Dataset):
    def __init__(self, manifest, sp, sample_rate=16000):
        with open(manifest) as f:
            self.items = [json.loads(l) for l in f]
        self.sp, self.sr = sp, sample_rate
        self.fbank = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=400, hop_length=160, n_mels=80)
        # frames at 10 ms hop, used by the sampler
        self.num_frames = [int(it["duration"] * 100) for it in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        wav, sr = torchaudio.load(it["audio_filepath"])
        if sr != self.sr:
            wav = torchaudio.functional.resample(wav, sr, self.sr)
        feats = (self.fbank(wav[0]) + 1e-6).log().transpose(0, 1)          # T, 80
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        tokens = torch.tensor(self.sp.encode(it["text"].lower()), dtype=torch.long)
        return feats, tokens, it["text"]


def collate(batch):
    feats, toks, texts = zip(*batch)
    f_len = torch.tensor([f.shape[0] for f in feats])
    t_len = torch.tensor([t.shape[0] for t in toks])
    feats = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    toks = nn.utils.rnn.pad_sequence(toks, batch_first=True)
    return feats, f_len, toks, t_len, list(texts)


class DurationBatchSampler(Sampler):
    """Shards utterances over ranks, then packs each shard into batches of <= max_frames."""

    def __init__(self, num_frames, max_frames, rank, world, shuffle=True, seed=0):
        self.num_frames, self.max_frames = num_frames, max_frames
        self.rank, self.world, self.shuffle, self.seed = rank, world, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.num_frames)))
        if self.shuffle:
            rng.shuffle(order)
        shard = order[self.rank::self.world]
        # sort inside chunks of 1000 so that similar lengths end up together
        shard = [i for c in range(0, len(shard), 1000)
                 for i in sorted(shard[c:c + 1000], key=self.num_frames.__getitem__)]
        batches, cur, longest = [], [], 0
        for i in shard:
            n = self.num_frames[i]
            if cur and max(longest, n) * (len(cur) + 1) > self.max_frames:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class ConformerCTC(nn.Module):
    def __init__(self, vocab, d_model=256, layers=16, heads=4):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, d_model, 3, 2), nn.ReLU(), nn.Conv2d(d_model, d_model, 3, 2), nn.ReLU())
        self.proj = nn.Linear(d_model * 19, d_model)
        self.encoder = torchaudio.models.Conformer(input_dim=d_model, num_heads=heads, ffn_dim=4 * d_model,
                                                   num_layers=layers, depthwise_conv_kernel_size=31,
                                                   dropout=0.1, use_group_norm=True)
        self.ctc_head = nn.Linear(d_model, vocab + 1)     # blank = last index

    def forward(self, feats, lengths):
        x = self.subsample(feats.unsqueeze(1))                    # B, C, T', F'
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lengths = ((lengths - 1) // 2 - 1) // 2
        x, lengths = self.encoder(x, lengths)
        return self.ctc_head(x).log_softmax(-1), lengths


@torch.no_grad()
def evaluate(model, loader, sp, blank, device):
    model.eval()
    errs, words = torch.zeros((), device=device), torch.zeros((), device=device)
    for feats, f_len, _, _, texts in loader:
        logp, out_len = model(feats.to(device), f_len.to(device))
        best = logp.argmax(-1).cpu()
        for seq, n, ref in zip(best, out_len.cpu(), texts):
            seq = torch.unique_consecutive(seq[:n]).tolist()
            hyp = sp.decode([s for s in seq if s != blank])
            errs += editdistance.eval(hyp.split(), ref.lower().split())
            words += len(ref.split())
    dist.all_reduce(errs)
    dist.all_reduce(words)
    return (errs / words).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest-dir", required=True)
    ap.add_argument("--spm", required=True)
    ap.add_argument("--exp", default="exp/conformer_ctc")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--max-frames", type=int, default=60000)
    ap.add_argument("--peak-lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    vocab = sp.get_piece_size()
    train_ds = ManifestDataset(os.path.join(args.manifest_dir, "train_960.jsonl"), sp)
    dev_ds = ManifestDataset(os.path.join(args.manifest_dir, "dev_clean.jsonl"), sp)
    train_bs = DurationBatchSampler(train_ds.num_frames, args.max_frames, rank, world, shuffle=True)
    dev_bs = DurationBatchSampler(dev_ds.num_frames, args.max_frames, rank, world, shuffle=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_bs, collate_fn=collate, num_workers=8, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_sampler=dev_bs, collate_fn=collate, num_workers=4)

    torch.manual_seed(1)
    model = DDP(ConformerCTC(vocab).to(device), device_ids=[local_rank])
    ctc = nn.CTCLoss(blank=vocab, zero_infinity=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    scaler = torch.cuda.amp.GradScaler()

    start = 0
    ckpt_path = os.path.join(args.exp, "last.pt")
    if os.path.exists(ckpt_path):
        st = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(st["model"]); opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"]); scaler.load_state_dict(st["scaler"])
        start = st["epoch"] + 1
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    for epoch in range(start, args.epochs):
        train_bs.set_epoch(epoch)
        model.train()
        tot, n, t0 = torch.zeros((), device=device), 0, time.time()
        for feats, f_len, toks, t_len, _ in train_loader:
            feats, f_len = feats.to(device, non_blocking=True), f_len.to(device)
            toks, t_len = toks.to(device, non_blocking=True), t_len.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logp, out_len = model(feats, f_len)
            loss = ctc(logp.float().transpose(0, 1), toks, out_len, t_len)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += loss.detach(); n += 1
            if rank == 0 and n % 200 == 0:
                print(f"[rank0] ep {epoch} it {n} loss {tot.item() / n:.3f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)

        wer = evaluate(model.module, dev_loader, sp, vocab, device)
        if rank == 0:
            print(f"=== epoch {epoch} dev-clean WER {wer * 100:.2f}%", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
