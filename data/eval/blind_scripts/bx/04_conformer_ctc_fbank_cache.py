"""Conformer-CTC on LibriSpeech with cached Kaldi fbank features.

Features are extracted once into <feat_dir>/<split>.pt and reused by later runs.
"""
import argparse
import glob
import logging
import math
import os
from dataclasses import dataclass

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

log = logging.getLogger(__name__)


@dataclass
class Config:
    libri_root: str = "/datasets/LibriSpeech"
    feat_dir: str = "/datasets/LibriSpeech/fbank80"
    bpe_model: str = "data/bpe_500.model"
    exp_dir: str = "exp/conformer_ctc"
    train_splits: tuple = ("train-clean-100",)
    dev_split: str = "dev-clean"
    n_mels: int = 80
    d_model: int = 256
    n_heads: int = 4
    ffn_dim: int = 1024
    n_layers: int = 12
    conv_kernel: int = 31
    dropout: float = 0.1
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 10000
    epochs: int = 60
    workers: int = 6


def load_transcripts(split_dir):
    trans = {}
    for f in glob.glob(os.path.join(split_dir, "*", "*", "*.trans.txt")):
        for line in open(f):
            uid, text = line.strip().split(" ", 1)
            trans[uid] = text
    return trans


def extract_fbank(cfg, split):
    split_dir = os.path.join(cfg.libri_root, split)
    trans = load_transcripts(split_dir)
    feats, texts, uids = [], [], []
    for uid in tqdm(sorted(trans), desc=f"fbank {split}", mininterval=30):
        spk, chap, _ = uid.split("-")
        wav, sr = torchaudio.load(os.path.join(split_dir, spk, chap, uid + ".flac"))
        fb = torchaudio.compliance.kaldi.fbank(wav * 32768, num_mel_bins=cfg.n_mels,
                                               sample_frequency=sr, dither=0.0)
        feats.append(fb.to(torch.float16))
        texts.append(trans[uid])
        uids.append(uid)
    return {"feats": feats, "texts": texts, "uids": uids}


def load_or_build_features(cfg, split):
    path = os.path.join(cfg.feat_dir, f"{split}.pt")
    if os.path.exists(path):
        return torch.load(path)
    os.makedirs(cfg.feat_dir, exist_ok=True)
    data = extract_fbank(cfg, split)
    torch.save(data, path)
    return data


class FbankDataset(Dataset):
    def __init__(self, parts, sp, specaug=False):
        self.feats = [f for p in parts for f in p["feats"]]
        self.texts = [t for p in parts for t in p["texts"]]
        self.sp = sp
        self.specaug = nn.Sequential(
            torchaudio.transforms.FrequencyMasking(27),
            torchaudio.transforms.FrequencyMasking(27),
            torchaudio.transforms.TimeMasking(40, p=0.05),
            torchaudio.transforms.TimeMasking(40, p=0.05),
        ) if specaug else None

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        x = self.feats[i].float()
        x = (x - x.mean(0)) / (x.std(0) + 1e-5)
        if self.specaug is not None:
            x = self.specaug(x.t().unsqueeze(0)).squeeze(0).t()
        y = torch.tensor(self.sp.encode(self.texts[i].lower()), dtype=torch.long)
        return x, y, self.texts[i]


def collate(batch):
    xs, ys, texts = zip(*batch)
    return (pad_sequence(xs, batch_first=True), torch.tensor([len(x) for x in xs]),
            pad_sequence(ys, batch_first=True), torch.tensor([len(y) for y in ys]), list(texts))


class ConformerCTC(nn.Module):
    def __init__(self, cfg, vocab_size):
        super().__init__()
        # 4x time subsampling with two stride-2 convs
        self.subsample = nn.Sequential(
            nn.Conv2d(1, cfg.d_model, 3, stride=2), nn.ReLU(),
            nn.Conv2d(cfg.d_model, cfg.d_model, 3, stride=2), nn.ReLU(),
        )
        freq = ((cfg.n_mels - 1) // 2 - 1) // 2
        self.proj = nn.Linear(cfg.d_model * freq, cfg.d_model)
        self.encoder = torchaudio.models.Conformer(
            input_dim=cfg.d_model, num_heads=cfg.n_heads, ffn_dim=cfg.ffn_dim,
            num_layers=cfg.n_layers, depthwise_conv_kernel_size=cfg.conv_kernel, dropout=cfg.dropout)
        self.out = nn.Linear(cfg.d_model, vocab_size + 1)   # last index = blank

    def forward(self, x, lens):
        x = self.subsample(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        lens = lens.clamp(max=t, min=1)
        x, lens = self.encoder(x, lens)
        return self.out(x).log_softmax(-1), lens


def noam(step, d_model, warmup):
    step = max(step, 1)
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


@torch.no_grad()
def dev_wer(model, loader, sp, blank, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, xl, _, _, texts in loader:
        lp, ol = model(x.to(device), xl.to(device))
        best = lp.argmax(-1).cpu()
        for seq, n, ref in zip(best, ol.cpu(), texts):
            ids = [int(t) for t in torch.unique_consecutive(seq[:n]) if int(t) != blank]
            hyp = sp.decode(ids).split()
            ref = ref.lower().split()
            acc[0] += torchaudio.functional.edit_distance(ref, hyp)
            acc[1] += len(ref)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in vars(cfg).items():
        if not isinstance(v, tuple):
            ap.add_argument(f"--{k}", type=type(v), default=v)
    for k, v in vars(ap.parse_args()).items():
        setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s")

    sp = spm.SentencePieceProcessor(model_file=cfg.bpe_model)
    blank = sp.get_piece_size()

    train_parts = [load_or_build_features(cfg, s) for s in cfg.train_splits]
    dev_part = load_or_build_features(cfg, cfg.dev_split)
    train_set = FbankDataset(train_parts, sp, specaug=True)
    dev_set = FbankDataset([dev_part], sp)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=cfg.workers, pin_memory=True)
    dev_loader = DataLoader(Subset(dev_set, range(rank, len(dev_set), world)),
                            batch_size=cfg.batch_size, collate_fn=collate, num_workers=2)

    model = DDP(ConformerCTC(cfg, sp.get_piece_size()).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: noam(s + 1, cfg.d_model, cfg.warmup) / noam(cfg.warmup, cfg.d_model, cfg.warmup))
    ctc = nn.CTCLoss(blank=blank, zero_infinity=True)

    os.makedirs(cfg.exp_dir, exist_ok=True)
    step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        for x, xl, y, yl, _ in train_loader:
            x, xl, y, yl = (t.to(device, non_blocking=True) for t in (x, xl, y, yl))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lp, ol = model(x, xl)
            loss = ctc(lp.float().transpose(0, 1), y, ol, yl)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                log.info("ep %d step %d ctc %.3f lr %.2e", epoch, step, loss.item(), scheduler.get_last_lr()[0])

        wer = dev_wer(model.module, dev_loader, sp, blank, device)
        log.info("epoch %d dev-clean WER %.2f", epoch, 100 * wer)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step, "epoch": epoch}, os.path.join(cfg.exp_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
