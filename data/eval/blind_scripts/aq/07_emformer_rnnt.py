"""Streaming Emformer RNN-T on LibriSpeech (torchaudio recipe, plain DDP loop).

torchrun --nproc_per_node=8 07_emformer_rnnt.py --librispeech-path /data/LibriSpeech \
    --sp-model-path spm_unigram_4096.model --global-stats-path global_stats.json
"""
import argparse
import json
import logging
import math
import os
import pathlib

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import emformer_rnnt_base

logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
log = logging.getLogger("rnnt")

_mel = torchaudio.transforms.MelSpectrogram(sample_rate=16000, n_fft=400, n_mels=80, hop_length=160)


def piecewise_linear_log(x):
    x = x.clone()
    x[x > math.e] = torch.log(x[x > math.e])
    x[x <= math.e] = x[x <= math.e] / math.e
    return x


class GlobalStatsNormalization(torch.nn.Module):
    def __init__(self, path):
        super().__init__()
        with open(path) as f:
            blob = json.load(f)
        self.register_buffer("mean", torch.tensor(blob["mean"]))
        self.register_buffer("invstddev", torch.tensor(blob["invstddev"]))

    def forward(self, x):
        return (x - self.mean) * self.invstddev


class Collate:
    def __init__(self, sp, right_pad=4):
        self.sp = sp
        self.blank = sp.get_piece_size()
        self.right_pad = right_pad

    def __call__(self, samples):
        feats, toks = [], []
        for wav, sr, transcript, *_ in samples:
            f = _mel(wav[0]).transpose(0, 1)  # T, 80
            feats.append(piecewise_linear_log(f * 2 ** 20))
            toks.append(torch.tensor(self.sp.encode(transcript.lower())))
        feat_lens = torch.tensor([f.size(0) for f in feats], dtype=torch.int32)
        feats = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
        feats = F.pad(feats, (0, 0, 0, self.right_pad))
        tgt_lens = torch.tensor([t.numel() for t in toks], dtype=torch.int32)
        tgts = torch.nn.utils.rnn.pad_sequence(toks, batch_first=True).int()
        prepended = F.pad(tgts, (1, 0), value=self.blank)
        return feats, feat_lens, tgts, tgt_lens, prepended


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--librispeech-path", type=pathlib.Path, required=True)
    p.add_argument("--sp-model-path", required=True)
    p.add_argument("--global-stats-path", required=True)
    p.add_argument("--exp-dir", type=pathlib.Path, default=pathlib.Path("exp/emformer_rnnt"))
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--num-workers", type=int, default=8)
    return p.parse_args()


def lr_lambda_factory(steps_per_epoch, warmup_epochs, total_epochs):
    warm, total = warmup_epochs * steps_per_epoch, total_epochs * steps_per_epoch
    def fn(step):
        if step < warm:
            return (step + 1) / warm
        return max(0.0, 0.96 ** ((step - warm) / steps_per_epoch))
    return fn


def rnnt_step(model, normalizer, batch, device, blank):
    feats, feat_lens, tgts, tgt_lens, prepended = [t.to(device, non_blocking=True) for t in batch]
    feats = normalizer(feats)
    logits, src_lens, _, _ = model(feats, feat_lens, prepended, tgt_lens)
    loss = torchaudio.functional.rnnt_loss(logits.float(), tgts, src_lens, tgt_lens, blank=blank,
                                           reduction="sum", clamp=-1)
    return loss, tgts.size(0)


@torch.no_grad()
def validate(model, normalizer, loader, device, blank):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        loss, n = rnnt_step(model, normalizer, batch, device, blank)
        acc[0] += loss
        acc[1] += n
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    sp = spm.SentencePieceProcessor(model_file=args.sp_model_path)
    blank = sp.get_piece_size()
    collate = Collate(sp)

    train_set = ConcatDataset([torchaudio.datasets.LIBRISPEECH(args.librispeech_path, url=u)
                               for u in ("train-clean-100", "train-clean-360", "train-other-500")])
    dev_set = ConcatDataset([torchaudio.datasets.LIBRISPEECH(args.librispeech_path, url=u)
                             for u in ("dev-clean", "dev-other")])
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=args.batch_size, sampler=DistributedSampler(dev_set, shuffle=False),
                            collate_fn=collate, num_workers=4)

    model = emformer_rnnt_base(num_symbols=blank + 1).to(device)
    normalizer = GlobalStatsNormalization(args.global_stats_path).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda_factory(len(train_loader), args.warmup_epochs, args.epochs))

    start_epoch = 0
    ckpt_path = args.exp_dir / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            log.info("resumed from epoch %d", ckpt["epoch"])

    if rank == 0:
        args.exp_dir.mkdir(parents=True, exist_ok=True)
    best = math.inf
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        running, seen = 0.0, 0
        for step, batch in enumerate(train_loader):
            loss, n = rnnt_step(model, normalizer, batch, device, blank)
            if not torch.isfinite(loss):
                log.warning("rank %d: non-finite loss at epoch %d step %d, skipping batch", rank, epoch, step)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            (loss / n).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            seen += n
            if rank == 0 and step % 200 == 0:
                log.info("epoch %d step %d/%d loss %.3f lr %.2e", epoch, step, len(train_loader),
                         running / max(seen, 1), scheduler.get_last_lr()[0])

        dev_loss = validate(model, normalizer, dev_loader, device, blank)
        if rank == 0:
            log.info("epoch %d dev loss/utt %.3f", epoch, dev_loss)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, args.exp_dir / "checkpoint.pt.tmp")
            os.replace(args.exp_dir / "checkpoint.pt.tmp", ckpt_path)
            if dev_loss < best:
                best = dev_loss
                torch.save(model.module.state_dict(), args.exp_dir / "best_model.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
