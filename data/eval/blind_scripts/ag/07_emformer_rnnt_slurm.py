#!/usr/bin/env python3
"""Streaming Emformer RNN-T on LibriSpeech 960h, multi-node via Slurm.

sbatch script (2 nodes x 4 GPUs):
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=10
    srun python 07_emformer_rnnt_slurm.py --librispeech-root /datasets --exp-dir /checkpoint/$USER/emformer_rnnt
"""
import argparse
import logging
import math
import os
import subprocess
import time

import sentencepiece as spm
import torch
import torch.distributed as dist
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, ConcatDataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

SEGMENT = 16
RIGHT_CONTEXT = 4
TIME_STRIDE = 4


def setup_distributed(port=29512):
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "MASTER_ADDR" not in os.environ:
        hostnames = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = hostnames.split()[0].decode()
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank)
    return rank, world_size, local_rank


class GlobalStatsNormalization(torch.nn.Module):
    def __init__(self, stats_file):
        super().__init__()
        stats = torch.load(stats_file, map_location="cpu")
        self.register_buffer("mean", stats["mean"])
        self.register_buffer("invstd", stats["invstddev"])

    def forward(self, x):
        return (x - self.mean) * self.invstd


class FeatureBatcher:
    def __init__(self, sp_model, stats_file):
        self.sp = sp_model
        self.mel = torchaudio.transforms.MelSpectrogram(sample_rate=16000, n_fft=400, n_mels=80, hop_length=160)
        self.norm = GlobalStatsNormalization(stats_file)
        self.blank = sp_model.get_piece_size()

    def __call__(self, samples):
        feats, texts = [], []
        for wav, sr, transcript, *_ in samples:
            f = self.mel(wav[0]).T
            f = torch.log(f + 1e-6)
            feats.append(self.norm(f))
            texts.append(transcript.lower())
        lengths = torch.tensor([f.size(0) for f in feats], dtype=torch.int32)
        feats = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
        # pad right context so the last segment sees its look-ahead
        feats = torch.nn.functional.pad(feats, (0, 0, 0, RIGHT_CONTEXT * TIME_STRIDE))
        tok = [torch.tensor(self.sp.encode(t)) for t in texts]
        tgt_len = torch.tensor([len(t) for t in tok], dtype=torch.int32)
        targets = torch.nn.utils.rnn.pad_sequence(tok, batch_first=True).int()
        prepended = torch.nn.functional.pad(targets, (1, 0), value=self.blank)
        return feats, lengths, targets, tgt_len, prepended, texts


def build_datasets(root):
    train = ConcatDataset([torchaudio.datasets.LIBRISPEECH(root, url=u)
                           for u in ("train-clean-100", "train-clean-360", "train-other-500")])
    dev = ConcatDataset([torchaudio.datasets.LIBRISPEECH(root, url=u) for u in ("dev-clean", "dev-other")])
    return train, dev


def warmup_cosine(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(prog, 1.0)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--librispeech-root", required=True)
    ap.add_argument("--sp-model", default="spm_unigram_4096.model")
    ap.add_argument("--global-stats", default="global_stats.pt")
    ap.add_argument("--exp-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--warmup", type=int, default=10000)
    ap.add_argument("--grad-clip", type=float, default=10.0)
    ap.add_argument("--num-workers", type=int, default=8)
    args = ap.parse_args()

    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s r{rank} %(message)s")
    log.info("world size %d", world_size)

    sp = spm.SentencePieceProcessor(model_file=args.sp_model)
    num_symbols = sp.get_piece_size() + 1  # + blank
    batcher = FeatureBatcher(sp, args.global_stats)

    train_set, dev_set = build_datasets(args.librispeech_root)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=batcher,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dev_shard = Subset(dev_set, range(rank, len(dev_set), world_size))
    dev_loader = DataLoader(dev_shard, batch_size=args.batch_size, collate_fn=batcher, num_workers=4)

    model = torchaudio.models.emformer_rnnt_base(num_symbols=num_symbols).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, args.warmup, total_steps))

    start_epoch = 0
    ckpt_path = os.path.join(args.exp_dir, "last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        log.info("resumed from epoch %d", ckpt["epoch"])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (feats, lengths, targets, tgt_len, prepended, _) in enumerate(train_loader):
            feats, lengths = feats.to(device), lengths.to(device)
            targets, tgt_len, prepended = targets.to(device), tgt_len.to(device), prepended.to(device)
            logits, src_len, _, _ = model(feats, lengths, prepended, tgt_len + 1)
            loss = torchaudio.functional.rnnt_loss(logits, targets, src_len.int(), tgt_len,
                                                   blank=num_symbols - 1, reduction="mean", clamp=-1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            if i % 100 == 0:
                log.info("ep %d it %d/%d loss %.4f gnorm %.2f lr %.2e %.1fs", epoch, i, len(train_loader),
                         loss.item(), gnorm.item(), scheduler.get_last_lr()[0], time.time() - t0)

        # dev loss (sum over all ranks)
        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for feats, lengths, targets, tgt_len, prepended, _ in dev_loader:
                feats, lengths = feats.to(device), lengths.to(device)
                targets, tgt_len, prepended = targets.to(device), tgt_len.to(device), prepended.to(device)
                logits, src_len, _, _ = model.module(feats, lengths, prepended, tgt_len + 1)
                loss = torchaudio.functional.rnnt_loss(logits, targets, src_len.int(), tgt_len,
                                                       blank=num_symbols - 1, reduction="sum")
                stats[0] += loss
                stats[1] += feats.size(0)
        dist.all_reduce(stats)
        log.info("epoch %d dev loss/utt %.4f", epoch, (stats[0] / stats[1]).item())

        if rank == 0:
            os.makedirs(args.exp_dir, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.exp_dir, f"epoch-{epoch}.pt"))
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
