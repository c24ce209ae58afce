"""Call-centre ASR: Transformer-CTC acoustic model on 8 kHz telephony audio (manifest of wav + transcript).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        17_asr_ctc_conformer.py --config configs/asr_ctc_large.yaml
"""
import argparse
import json
import logging
import os
import random
from dataclasses import dataclass

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("asr")
VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


@dataclass
class ASRConfig:
    train_manifest: str = "/data/asr/train.jsonl"
    dev_manifest: str = "/data/asr/dev.jsonl"
    sample_rate: int = 8000
    n_mels: int = 80
    d_model: int = 512
    n_layers: int = 16
    n_heads: int = 8
    layerdrop: float = 0.1
    grad_ckpt: bool = True
    batch_size: int = 24
    lr: float = 1e-3
    warmup: int = 5000
    epochs: int = 60
    ckpt_dir: str = "/ckpt/asr_ctc_large"


class ManifestDataset(Dataset):
    def __init__(self, path, cfg: ASRConfig, max_sec=20.0):
        rows = [json.loads(l) for l in open(path)]
        self.rows = [r for r in rows if r["duration"] <= max_sec]
        self.mel = torchaudio.transforms.MelSpectrogram(cfg.sample_rate, n_fft=256, hop_length=80, n_mels=cfg.n_mels)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, _ = torchaudio.load(r["audio"])
        feats = torch.log(self.mel(wav[0]) + 1e-6).T  # [T, n_mels]
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        text = r["text"].lower()
        return feats, torch.tensor([CHAR2ID[c] for c in text if c in CHAR2ID]), text


def collate(batch):
    feats, targets, texts = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats])
    x = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    return x, feat_lens, torch.cat(targets), torch.tensor([len(t) for t in targets]), list(texts)


class CTCTransformer(nn.Module):
    def __init__(self, cfg: ASRConfig):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, 64, 3, 2), nn.ReLU(), nn.Conv2d(64, 64, 3, 2), nn.ReLU())
        self.proj = nn.Linear(64 * (((cfg.n_mels - 1) // 2 - 1) // 2), cfg.d_model)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, 4 * cfg.d_model, 0.1, batch_first=True,
                                       norm_first=True) for _ in range(cfg.n_layers)])
        self.norm = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, len(VOCAB))
        self.layerdrop, self.grad_ckpt = cfg.layerdrop, cfg.grad_ckpt

    def forward(self, x, lens):
        x = self.subsample(x.unsqueeze(1))  # B, C, T', F'
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        out_lens = ((lens - 1) // 2 - 1) // 2
        pad_mask = torch.arange(t, device=x.device)[None, :] >= out_lens[:, None]
        for layer in self.layers:
            if self.training and random.random() < self.layerdrop:
                continue
            if self.training and self.grad_ckpt:
                x = checkpoint(layer, x, None, pad_mask, use_reentrant=True)
            else:
                x = layer(x, src_key_padding_mask=pad_mask)
        return self.out(self.norm(x)).log_softmax(-1), out_lens


def greedy_decode(log_probs, lens):
    hyps = []
    for seq, n in zip(log_probs.argmax(-1).tolist(), lens.tolist()):
        prev, chars = 0, []
        for idx in seq[:n]:
            if idx != prev and idx != 0:
                chars.append(VOCAB[idx])
            prev = idx
        hyps.append("".join(chars))
    return hyps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = ASRConfig(**yaml.safe_load(open(ap.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    # same seed everywhere so LayerDrop skips the same layers on every rank
    random.seed(1234)
    torch.manual_seed(1234)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    train_ds, dev_ds = ManifestDataset(cfg.train_manifest, cfg), ManifestDataset(cfg.dev_manifest, cfg)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=cfg.batch_size, collate_fn=collate, num_workers=4,
                            sampler=DistributedSampler(dev_ds, shuffle=False))

    model = CTCTransformer(cfg).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=cfg.layerdrop > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / cfg.warmup, (cfg.warmup / (s + 1)) ** 0.5))
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, lens, tgt, tgt_lens, _) in enumerate(train_loader):
            x, lens = x.to(device, non_blocking=True), lens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                log_probs, out_lens = model(x, lens)
            loss = ctc(log_probs.float().transpose(0, 1), tgt, out_lens.cpu(), tgt_lens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                logger.info("epoch %d step %d loss %.3f lr %.2e", epoch, step, loss.item(), sched.get_last_lr()[0])

        model.eval()
        errs = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, lens, _, _, texts in dev_loader:
                log_probs, out_lens = model(x.to(device), lens.to(device))
                for hyp, ref in zip(greedy_decode(log_probs, out_lens), texts):
                    errs[0] += editdistance.eval(hyp.split(), ref.split())
                    errs[1] += len(ref.split())
        dist.all_reduce(errs)
        if rank == 0:
            logger.info("epoch %d dev WER %.4f", epoch, (errs[0] / errs[1]).item())
            os.makedirs(cfg.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(cfg.ckpt_dir, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
