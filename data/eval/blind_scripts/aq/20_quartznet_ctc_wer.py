"""QuartzNet 5x5 CTC (character) on LibriSpeech, DDP.

torchrun --nproc_per_node=8 20_quartznet_ctc_wer.py --config conf/quartznet5x5.yaml
"""
import argparse
import json
import os
import time

import jiwer
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB = list(" abcdefghijklmnopqrstuvwxyz'")
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}
BLANK = len(VOCAB)


class JsonManifest(Dataset):
    def __init__(self, path, max_duration=None):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        if max_duration:
            rows = [r for r in rows if r["duration"] <= max_duration]
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, _ = torchaudio.load(r["audio_filepath"])
        text = r["text"].lower()
        return wav[0], torch.tensor([CHAR2ID[c] for c in text if c in CHAR2ID]), text


def collate(b):
    wavs, ys, texts = zip(*b)
    return (nn.utils.rnn.pad_sequence(wavs, batch_first=True), torch.tensor([w.numel() for w in wavs]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True), torch.tensor([y.numel() for y in ys]), list(texts))


class Preprocessor(nn.Module):
    def __init__(self, n_mels=64):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=320, hop_length=160,
                                                        n_mels=n_mels)
        self.specaug = nn.Sequential(torchaudio.transforms.FrequencyMasking(15),
                                     torchaudio.transforms.FrequencyMasking(15),
                                     torchaudio.transforms.TimeMasking(25), torchaudio.transforms.TimeMasking(25))

    @torch.no_grad()
    def forward(self, wav, wav_len, augment):
        x = torch.log(self.mel(wav) + 2 ** -24)
        lens = wav_len // 160 + 1
        mask = torch.arange(x.size(-1), device=x.device)[None] < lens[:, None]
        n = lens[:, None].float()
        mean = (x * mask[:, None]).sum(-1, keepdim=True) / n[..., None]
        var = (((x - mean) * mask[:, None]) ** 2).sum(-1, keepdim=True) / (n[..., None] - 1)
        x = (x - mean) / (var.sqrt() + 1e-5) * mask[:, None]
        if augment:
            x = self.specaug(x)
        return x, lens


class SepConvBlock(nn.Module):
    def __init__(self, cin, cout, k, repeat, dropout, stride=1, dilation=1, residual=True):
        super().__init__()
        layers = []
        for r in range(repeat):
            c_in = cin if r == 0 else cout
            layers += [nn.Conv1d(c_in, c_in, k, stride=stride, dilation=dilation, groups=c_in,
                                 padding=dilation * (k - 1) // 2, bias=False),
                       nn.Conv1d(c_in, cout, 1, bias=False), nn.BatchNorm1d(cout)]
            if r < repeat - 1:
                layers += [nn.ReLU(), nn.Dropout(dropout)]
        self.body = nn.Sequential(*layers)
        self.res = nn.Sequential(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout)) if residual else None
        self.out = nn.Sequential(nn.ReLU(), nn.Dropout(dropout))

    def forward(self, x):
        y = self.body(x)
        if self.res is not None:
            y = y + self.res(x)
        return self.out(y)


class QuartzNet(nn.Module):
    def __init__(self, n_mels=64, n_vocab=len(VOCAB) + 1, dropout=0.0):
        super().__init__()
        self.pre = Preprocessor(n_mels)
        blocks = [SepConvBlock(n_mels, 256, 33, 1, dropout, stride=2, residual=False)]
        spec = [(256, 33), (256, 39), (512, 51), (512, 63), (512, 75)]
        cin = 256
        for cout, k in spec:
            blocks.append(SepConvBlock(cin, cout, k, 5, dropout))
            cin = cout
        blocks += [SepConvBlock(512, 512, 87, 1, dropout, dilation=2, residual=False),
                   SepConvBlock(512, 1024, 1, 1, dropout, residual=False)]
        self.encoder = nn.Sequential(*blocks)
        self.decoder = nn.Conv1d(1024, n_vocab, 1)

    def forward(self, wav, wav_len, augment=False):
        x, lens = self.pre(wav, wav_len, augment)
        logits = self.decoder(self.encoder(x)).transpose(1, 2)
        return logits.log_softmax(-1), (lens + 1) // 2

    @torch.no_grad()
    def transcribe(self, wav, wav_len):
        lp, lens = self.forward(wav, wav_len)
        out = []
        for p, n in zip(lp.argmax(-1).cpu(), lens.cpu()):
            ids = [int(i) for i in torch.unique_consecutive(p[:n]) if i != BLANK]
            out.append("".join(VOCAB[i] for i in ids).strip())
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    train_ds = JsonManifest(cfg["train_manifest"], cfg["max_duration"])
    dev_ds = JsonManifest(cfg["dev_manifest"])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, collate_fn=collate,
                          num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, cfg["batch_size"], sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=collate, num_workers=4)

    model = QuartzNet(dropout=cfg["dropout"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.95, 0.5), weight_decay=cfg["weight_decay"])
    total_steps = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=total_steps,
                                                pct_start=cfg["warmup_ratio"], anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(cfg["exp_dir"], exist_ok=True)
    best_wer, step = 1e9, 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, wl, y, yl, _ in train_dl:
            wav, wl, y, yl = wav.to(device), wl.to(device), y.to(device), yl.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                lp, ol = model(wav, wl, augment=True)
            loss = F.ctc_loss(lp.float().transpose(0, 1), y, ol, yl, blank=BLANK, zero_infinity=True)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)

        model.eval()
        errs = torch.zeros(2, device=device)
        for wav, wl, _, _, texts in dev_dl:
            hyps = model.transcribe(wav.to(device), wl.to(device))
            for ref, hyp in zip(texts, hyps):
                m = jiwer.process_words(ref, hyp)
                errs[0] += m.substitutions + m.deletions + m.insertions
                errs[1] += len(ref.split())
        dist.all_reduce(errs)
        wer = (errs[0] / errs[1]).item()
        if rank == 0:
            print(f"epoch {epoch} dev WER {wer * 100:.2f}%", flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(cfg["exp_dir"], "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(ckpt, os.path.join(cfg["exp_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
