"""Joint CTC/attention Conformer encoder-decoder ASR with Lhotse dataloading.

torchrun --nproc_per_node=8 11_aed_conformer_lhotse.py --train-cuts data/cuts_train.jsonl.gz \
    --dev-cuts data/cuts_dev.jsonl.gz --bpe-model data/bpe_500/bpe.model --exp-dir exp/aed
"""
import argparse
import logging
import math
import os
from pathlib import Path

import editdistance
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lhotse import CutSet, Fbank, FbankConfig
from lhotse.dataset import DynamicBucketingSampler, K2SpeechRecognitionDataset, SpecAugment
from lhotse.dataset.input_strategies import OnTheFlyFeatures
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torchaudio.models import Conformer


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train-cuts", type=Path, required=True)
    p.add_argument("--dev-cuts", type=Path, required=True)
    p.add_argument("--bpe-model", required=True)
    p.add_argument("--exp-dir", type=Path, default=Path("exp/aed"))
    p.add_argument("--max-duration", type=float, default=300.0)
    p.add_argument("--num-epochs", type=int, default=50)
    p.add_argument("--lr-factor", type=float, default=5.0)
    p.add_argument("--warm-step", type=int, default=25000)
    p.add_argument("--ctc-weight", type=float, default=0.3)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seed", type=int, default=42)
    return p


class AED(nn.Module):
    def __init__(self, vocab, d=256, enc_layers=12, dec_layers=6, heads=4):
        super().__init__()
        self.sos = self.eos = vocab - 1
        self.ignore = -1
        self.sub = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.sub_proj = nn.Linear(d * 19, d)
        self.encoder = Conformer(d, heads, 4 * d, enc_layers, 31, dropout=0.1)
        self.ctc_proj = nn.Linear(d, vocab)
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, 512, d) * 0.02)
        layer = nn.TransformerDecoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, dec_layers)
        self.out = nn.Linear(d, vocab)

    def encode(self, x, xl):
        x = self.sub(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.sub_proj(x.transpose(1, 2).reshape(b, t, c * f))
        xl = (((xl - 1) // 2 - 1) // 2).clamp(1, t)
        return self.encoder(x, xl)

    def decode(self, memory, mem_mask, ys_in):
        L = ys_in.size(1)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=ys_in.device), 1)
        h = self.embed(ys_in) + self.pos[:, :L]
        h = self.decoder(h, memory, tgt_mask=causal, memory_key_padding_mask=mem_mask)
        return self.out(h)

    def forward(self, x, xl, ys, ctc_weight):
        enc, el = self.encode(x, xl)
        mem_mask = torch.arange(enc.size(1), device=enc.device)[None] >= el[:, None]
        # CTC
        lp = self.ctc_proj(enc).log_softmax(-1).transpose(0, 1)
        yl = torch.tensor([len(y) for y in ys], device=x.device)
        flat = torch.cat([torch.tensor(y, device=x.device) for y in ys])
        loss_ctc = F.ctc_loss(lp, flat, el, yl, blank=0, reduction="sum", zero_infinity=True)
        # attention
        ys_in = nn.utils.rnn.pad_sequence([torch.tensor([self.sos] + y, device=x.device) for y in ys],
                                          batch_first=True, padding_value=self.eos)
        ys_out = nn.utils.rnn.pad_sequence([torch.tensor(y + [self.eos], device=x.device) for y in ys],
                                           batch_first=True, padding_value=self.ignore)
        logits = self.decode(enc, mem_mask, ys_in)
        loss_att = F.cross_entropy(logits.transpose(1, 2), ys_out, ignore_index=self.ignore,
                                   label_smoothing=0.1, reduction="sum")
        return ctc_weight * loss_ctc + (1 - ctc_weight) * loss_att, loss_ctc.detach(), loss_att.detach()

    @torch.no_grad()
    def greedy(self, x, xl, max_len=200):
        enc, el = self.encode(x, xl)
        mem_mask = torch.arange(enc.size(1), device=enc.device)[None] >= el[:, None]
        ys = torch.full((x.size(0), 1), self.sos, dtype=torch.long, device=x.device)
        done = torch.zeros(x.size(0), dtype=torch.bool, device=x.device)
        for _ in range(max_len):
            nxt = self.decode(enc, mem_mask, ys)[:, -1].argmax(-1)
            nxt = nxt.masked_fill(done, self.eos)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt.eq(self.eos)
            if done.all():
                break
        return [[t for t in row[1:].tolist() if t != self.eos] for row in ys]


def noam(step, d, warm, factor):
    step = max(step, 1)
    return factor * d ** -0.5 * min(step ** -0.5, step * warm ** -1.5)


def make_loader(cuts, max_duration, train):
    sampler = DynamicBucketingSampler(cuts, max_duration=max_duration, shuffle=train, num_buckets=30,
                                      drop_last=train)
    ds = K2SpeechRecognitionDataset(
        input_strategy=OnTheFlyFeatures(Fbank(FbankConfig(num_mel_bins=80))),
        input_transforms=[SpecAugment(num_frame_masks=10, features_mask_size=27, frames_mask_size=100)] if train else [],
        return_cuts=True)
    return DataLoader(ds, sampler=sampler, batch_size=None, num_workers=4, persistent_workers=train), sampler


def validate(model, loader, sp, device):
    model.eval()
    errors, words = 0, 0
    for batch in loader:
        x = batch["inputs"].to(device)
        xl = batch["supervisions"]["num_frames"].to(device)
        hyps = model.module.greedy(x, xl)
        for hyp, ref in zip(hyps, batch["supervisions"]["text"]):
            ref_w = ref.split()
            errors += editdistance.eval(sp.decode(hyp).split(), ref_w)
            words += len(ref_w)
    stats = torch.tensor([errors, words], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = get_parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s")
    dist.init_process_group("nccl")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=args.bpe_model)
    vocab = sp.get_piece_size() + 1  # + <sos/eos>; id 0 (<blk>) doubles as CTC blank

    train_cuts = CutSet.from_file(args.train_cuts).filter(lambda c: 1.0 <= c.duration <= 20.0)
    train_dl, train_sampler = make_loader(train_cuts, args.max_duration, train=True)
    dev_dl, _ = make_loader(CutSet.from_file(args.dev_cuts), args.max_duration, train=False)

    model = DDP(AED(vocab, d=args.d_model).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: noam(s, args.d_model, args.warm_step, args.lr_factor))

    if rank == 0:
        args.exp_dir.mkdir(parents=True, exist_ok=True)
    best_wer = math.inf
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_dl):
            x = batch["inputs"].to(device)
            xl = batch["supervisions"]["num_frames"].to(device)
            ys = sp.encode(batch["supervisions"]["text"])
            loss, l_ctc, l_att = model(x, xl, ys, args.ctc_weight)
            n = len(ys)
            opt.zero_grad(set_to_none=True)
            (loss / n).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                logging.info(f"epoch {epoch} batch {i} loss {loss.item() / n:.3f} ctc {l_ctc.item() / n:.3f} "
                             f"att {l_att.item() / n:.3f} lr {sched.get_last_lr()[0]:.2e}")

        wer = validate(model, dev_dl, sp, device)
        if rank == 0:
            logging.info(f"epoch {epoch} dev WER {100 * wer:.2f}")
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch}, args.exp_dir / f"epoch-{epoch}.pt")
            if wer < best_wer:
                best_wer = wer
                torch.save(model.module.state_dict(), args.exp_dir / "best-model.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
