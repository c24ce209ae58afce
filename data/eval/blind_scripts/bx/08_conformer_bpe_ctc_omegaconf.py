"""Conformer-CTC with BPE targets, on-the-fly log-mel features on the GPU.

    torchrun --nproc_per_node=8 08_conformer_bpe_ctc_omegaconf.py conf/conformer_m.yaml trainer.epochs=100
"""
import math
import os
import sys
import time

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.functional import edit_distance

DEFAULTS = OmegaConf.create({
    "data": {"train": "manifests/train_960.tsv", "dev": "manifests/dev_other.tsv",
             "bpe": "bpe/unigram1024.model", "max_sec": 20.0, "batch_size": 24, "workers": 8},
    "model": {"n_mels": 80, "d": 256, "heads": 4, "ffn": 1024, "layers": 16, "kernel": 31, "dropout": 0.1},
    "specaug": {"freq_masks": 2, "F": 27, "time_masks": 10, "T": 0.05},
    "trainer": {"epochs": 100, "peak_lr": 1e-3, "warmup": 10000, "clip": 5.0, "exp": "exp/conformer_m",
                "log_every": 100},
})


class Manifest(Dataset):
    def __init__(self, path, sp, max_sec):
        self.rows = []
        for line in open(path):
            wav, n, text = line.rstrip("\n").split("\t", 2)
            if int(n) / 16000 <= max_sec:
                self.rows.append((wav, text))
        self.sp = sp

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        wav, text = self.rows[i]
        audio, sr = torchaudio.load(wav)
        if sr != 16000:
            audio = torchaudio.functional.resample(audio, sr, 16000)
        return audio[0], torch.tensor(self.sp.encode(text.lower())), text


def collate(batch):
    audio, tok, text = zip(*batch)
    alen = torch.tensor([a.numel() for a in audio])
    tlen = torch.tensor([t.numel() for t in tok])
    A = torch.nn.utils.rnn.pad_sequence(audio, batch_first=True)
    T = torch.nn.utils.rnn.pad_sequence(tok, batch_first=True)
    return A, alen, T, tlen, list(text)


class SpecAugment(nn.Module):
    def __init__(self, freq_masks, F, time_masks, T):
        super().__init__()
        self.fm = nn.ModuleList([torchaudio.transforms.FrequencyMasking(F, iid_masks=True)
                                 for _ in range(freq_masks)])
        self.time_masks, self.T = time_masks, T

    def forward(self, x):                        # (B, F, T)
        for m in self.fm:
            x = m(x)
        max_t = max(1, int(self.T * x.size(-1)))
        for _ in range(self.time_masks):
            x = torchaudio.functional.mask_along_axis_iid(x.unsqueeze(1), max_t, 0.0, 3).squeeze(1)
        return x


class ConformerCTC(nn.Module):
    def __init__(self, mc, sc, vocab):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=mc.n_mels)
        self.specaug = SpecAugment(sc.freq_masks, sc.F, sc.time_masks, sc.T)
        self.sub = nn.Sequential(nn.Conv1d(mc.n_mels, mc.d, 3, 2, 1), nn.GELU(),
                                 nn.Conv1d(mc.d, mc.d, 3, 2, 1), nn.GELU())
        self.enc = torchaudio.models.Conformer(mc.d, mc.heads, mc.ffn, mc.layers, mc.kernel, dropout=mc.dropout)
        self.head = nn.Linear(mc.d, vocab + 1)

    def forward(self, audio, alen):
        with torch.autocast("cuda", enabled=False):
            x = (self.mel(audio.float()) + 1e-6).log()
        x = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5)
        if self.training:
            x = self.specaug(x)
        x = self.sub(x).transpose(1, 2)
        lens = torch.div(alen, 160, rounding_mode="floor") + 1
        lens = ((lens - 1) // 2 + 1 - 1) // 2 + 1
        lens = lens.clamp(max=x.size(1))
        x, lens = self.enc(x, lens)
        return self.head(x).log_softmax(-1), lens


def ctc_greedy(logp, lens, blank):
    out = []
    for seq, n in zip(logp.argmax(-1), lens):
        seq = torch.unique_consecutive(seq[: int(n)])
        out.append([int(t) for t in seq if int(t) != blank])
    return out


@torch.no_grad()
def evaluate(model, loader, sp, blank, device):
    model.eval()
    errors, words = 0, 0
    for A, alen, _, _, text in loader:
        logp, lens = model(A.to(device), alen.to(device))
        for ids, ref in zip(ctc_greedy(logp, lens, blank), text):
            ref = ref.lower().split()
            errors += edit_distance(ref, sp.decode(ids).split())
            words += len(ref)
    model.train()
    stats = torch.tensor([errors, words], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return stats[0].item() / max(stats[1].item(), 1.0)


def main():
    cfg = OmegaConf.merge(DEFAULTS, OmegaConf.load(sys.argv[1]), OmegaConf.from_dotlist(sys.argv[2:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1337)

    sp = spm.SentencePieceProcessor(model_file=cfg.data.bpe)
    vocab = sp.get_piece_size()
    train_ds = Manifest(cfg.data.train, sp, cfg.data.max_sec)
    dev_ds = Manifest(cfg.data.dev, sp, 1e9)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.data.batch_size, sampler=train_sampler,
                          num_workers=cfg.data.workers, collate_fn=collate, pin_memory=True)
    dev_idx = list(range(rank, len(dev_ds), world))
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, dev_idx), batch_size=16,
                        num_workers=2, collate_fn=collate)

    model = ConformerCTC(cfg.model, cfg.specaug, vocab).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    warm = cfg.trainer.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, math.sqrt(warm / (s + 1))))
    ctc = nn.CTCLoss(blank=vocab, reduction="mean", zero_infinity=True)

    if rank == 0:
        os.makedirs(cfg.trainer.exp, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.trainer.exp, "config.yaml"))

    step, best = 0, float("inf")
    for epoch in range(cfg.trainer.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        running = torch.zeros(2, device=device)
        for A, alen, T, tlen, _ in train_dl:
            A, alen, T, tlen = A.to(device), alen.to(device), T.to(device), tlen.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp, olen = model(A, alen)
            loss = ctc(logp.float().transpose(0, 1), T, olen, tlen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.clip)
            opt.step()
            sched.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % cfg.trainer.log_every == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"[ep {epoch} step {step}] ctc {running[0] / running[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s", flush=True)
                running.zero_()

        wer = evaluate(model.module, dev_dl, sp, vocab, device)
        if rank == 0:
            print(f"epoch {epoch} dev WER {100 * wer:.2f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "step": step, "epoch": epoch}
            torch.save(ckpt, os.path.join(cfg.trainer.exp, "last.pt"))
            if wer < best:
                best = wer
                torch.save(ckpt, os.path.join(cfg.trainer.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
