"""AVSR training with periodic test-set decoding and per-utterance error analysis (LRS3 test, 1321 utts).

Hybrid CTC/attention model; decoding uses attention beam search with a CTC-weighted end-of-sentence
score. Per-utterance (errors, ref words, SNR bucket) rows are collected on rank 0 to report WER per
noise level.

    torchrun --nproc_per_node=8 14_avsr_hybrid_decoding.py --cfg conf/avsr_noisy.yaml
"""
import argparse
import math
import os
import random

import editdistance
import numpy as np
import sentencepiece as spm
import soundfile as sf
import torch
import torchaudio
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SNR_LEVELS = [-5, 0, 5, 10, 20, 999]  # 999 = clean


class NoisyAV(Dataset):
    def __init__(self, list_file, root, sp, noise_wavs, train, fixed_snr=None):
        self.rows = [l.rstrip("\n").split("\t") for l in open(list_file)]
        self.root, self.sp, self.noise, self.train, self.fixed_snr = root, sp, noise_wavs, train, fixed_snr

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        uid, text = self.rows[i]
        v = np.load(os.path.join(self.root, "roi", uid + ".npy"))
        wav, _ = sf.read(os.path.join(self.root, "wav", uid + ".wav"), dtype="float32")
        oy, ox = (random.randint(0, 8), random.randint(0, 8)) if self.train else (4, 4)
        v = (v[:, oy:oy + 88, ox:ox + 88].astype(np.float32) / 255.0 - 0.421) / 0.165
        snr = random.choice(SNR_LEVELS) if self.train else self.fixed_snr
        if snr is not None and snr != 999:
            rng = np.random.default_rng(i) if not self.train else np.random.default_rng()
            noise, _ = sf.read(self.noise[rng.integers(len(self.noise))], dtype="float32")
            noise = np.resize(noise, wav.shape)
            k = np.sqrt((wav ** 2).mean() / ((noise ** 2).mean() * 10 ** (snr / 10) + 1e-9))
            wav = wav + k * noise
        a = torch.from_numpy(wav)
        spec = torch.stft(a, 400, 160, window=torch.hann_window(400), return_complex=True).abs().pow(2)
        fb = torch.log(F.linear(spec.T, MEL_FB) + 1e-6)[: 4 * len(v)]
        fb = F.pad(fb, (0, 0, 0, 4 * len(v) - len(fb)))
        fb = (fb - fb.mean(0)) / (fb.std(0) + 1e-5)
        return torch.from_numpy(v), fb, torch.tensor(self.sp.encode(text)) + 1, text, snr if snr is not None else 999


def mel_filterbank(n_fft=400, n_mels=80, sr=16000):
    return torchaudio.functional.melscale_fbanks(n_fft // 2 + 1, 0.0, sr / 2, n_mels, sr).T.contiguous()


MEL_FB = mel_filterbank()


def collate(b):
    v, a, y, t, snr = zip(*b)
    ps = nn.utils.rnn.pad_sequence
    return (ps(v, True), ps(a, True), torch.tensor([len(x) for x in v]), ps(y, True),
            torch.tensor([len(x) for x in y]), t, torch.tensor(snr))


class AVSR(nn.Module):
    def __init__(self, vocab, d=512, n_enc=12, n_dec=6):
        super().__init__()
        self.vfront = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64), nn.ReLU(True),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
            nn.Conv3d(64, 192, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(192), nn.ReLU(True),
            nn.Conv3d(192, d, (3, 3, 3), (1, 2, 2), 1, bias=False), nn.BatchNorm3d(d), nn.ReLU(True))
        self.afront = nn.Sequential(nn.Conv1d(80, d, 3, 2, 1), nn.GELU(), nn.Conv1d(d, d, 3, 2, 1), nn.GELU())
        self.gate = nn.Linear(2 * d, d)
        self.pos = nn.Embedding(2000, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True), n_enc)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True), n_dec)
        self.emb = nn.Embedding(vocab, d)
        self.ctc_lin, self.out = nn.Linear(d, vocab), nn.Linear(d, vocab)
        self.eos = vocab - 1

    def encode(self, v, a, lens):
        t = v.size(1)
        hv = self.vfront(v.unsqueeze(1)).mean((3, 4)).transpose(1, 2)
        ha = self.afront(a.transpose(1, 2)).transpose(1, 2)[:, :t]
        g = torch.sigmoid(self.gate(torch.cat([hv, ha], -1)))
        x = g * hv + (1 - g) * ha + self.pos.weight[:t]
        m = torch.arange(t, device=v.device)[None] >= lens[:, None]
        return self.encoder(x, src_key_padding_mask=m), m

    def dec_logp(self, ys, mem, m):
        L = ys.size(1)
        h = self.decoder(self.emb(ys) + self.pos.weight[:L], mem, memory_key_padding_mask=m,
                         tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=ys.device))
        return self.out(h).float().log_softmax(-1)

    def forward(self, v, a, lens, y, ylens, ctc_w):
        mem, m = self.encode(v, a, lens)
        l_ctc = F.ctc_loss(self.ctc_lin(mem).float().log_softmax(-1).transpose(0, 1), y, lens, ylens, zero_infinity=True)
        yi = F.pad(y, (1, 0), value=self.eos)
        yo = F.pad(y, (0, 1))
        yo[torch.arange(len(y)), ylens] = self.eos
        yo = yo.masked_fill(torch.arange(yo.size(1), device=y.device)[None] > ylens[:, None], -100)
        l_att = F.nll_loss(self.dec_logp(yi, mem, m).flatten(0, 1), yo.flatten(), ignore_index=-100)
        return ctc_w * l_ctc + (1 - ctc_w) * l_att

    @torch.no_grad()
    def decode(self, v, a, beam=8, ctc_w=0.3, max_len=100):
        lens = torch.tensor([v.size(1)], device=v.device)
        mem, m = self.encode(v, a, lens)
        ctc_lp = self.ctc_lin(mem).float().log_softmax(-1).transpose(0, 1)
        hyps, finals = [([self.eos], 0.0)], []
        for _ in range(max_len):
            ys = torch.tensor([h for h, _ in hyps], device=v.device)
            lp = self.dec_logp(ys, mem.expand(len(hyps), -1, -1), m.expand(len(hyps), -1))[:, -1]
            cand = []
            for (h, s), row in zip(hyps, lp):
                top = row.topk(beam)
                cand.extend((h + [k], s + x) for x, k in zip(top.values.tolist(), top.indices.tolist()))
            cand.sort(key=lambda c: -c[1])
            hyps = []
            for h, s in cand[:beam]:
                if h[-1] == self.eos:
                    toks = h[1:-1]
                    if toks and len(toks) <= v.size(1):
                        ctc = -F.ctc_loss(ctc_lp, torch.tensor([toks], device=v.device), lens,
                                          torch.tensor([len(toks)], device=v.device), reduction="sum").item()
                        finals.append((toks, (1 - ctc_w) * s + ctc_w * ctc))
                else:
                    hyps.append((h, s))
            if not hyps:
                break
        if not finals:
            return [t for t in hyps[0][0][1:]] if hyps else []
        return max(finals, key=lambda f: f[1] / (len(f[0]) + 1))[0]


def test_by_snr(net, cfg, sp, noise, rank, world, device):
    net.eval()
    rows = []
    for snr in SNR_LEVELS:
        ds = NoisyAV(cfg["test_list"], cfg["root"], sp, noise, train=False, fixed_snr=snr)
        for i in range(rank, len(ds), world):
            v, a, _, text, _ = ds[i]
            hyp = sp.decode([t - 1 for t in net.decode(v[None].to(device), a[None].to(device))])
            rows.append([editdistance.eval(hyp.split(), text.split()), len(text.split()), snr])
    local = torch.tensor(rows, dtype=torch.long, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    net.train()
    if rank != 0:
        return None
    table = torch.cat(gathered).cpu()
    return {snr: (table[table[:, 2] == snr, 0].sum() / table[table[:, 2] == snr, 1].sum()).item()
            for snr in SNR_LEVELS}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 1))
    random.seed(cfg.get("seed", 1) + rank)

    sp = spm.SentencePieceProcessor(model_file=cfg["spm"])
    V = sp.get_piece_size() + 2
    noise = [l.strip() for l in open(cfg["noise_list"])]
    train_ds = NoisyAV(cfg["train_list"], cfg["root"], sp, noise, train=True)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, num_workers=8, collate_fn=collate,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(AVSR(V)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), weight_decay=0.03)
    total = cfg["epochs"] * len(loader)
    warm = cfg.get("warmup", 5000)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, max(0, s - warm) / (total - warm))))))
    os.makedirs(cfg["exp"], exist_ok=True)

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for it, (v, a, lens, y, ylens, _, _) in enumerate(loader):
            v, a, lens, y, ylens = (x.to(device, non_blocking=True) for x in (v, a, lens, y, ylens))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(v, a, lens, y, ylens, cfg.get("ctc_weight", 0.1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(cfg["exp"], "last.pt"))
        if (epoch + 1) % cfg.get("test_every", 10) == 0:
            res = test_by_snr(model.module, cfg, sp, noise, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch} test WER by SNR: " +
                      ", ".join(f"{'clean' if s == 999 else f'{s}dB'}={100 * w:.1f}" for s, w in res.items()), flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
