"""Decoder-only fine-tuning of Whisper-small (encoder frozen) for domain adaptation.

Training data are jsonl manifests {"audio": path, "text": ..., "duration": sec}.
Evaluation uses beam search on a held-out set; WER is computed over the union of
all ranks' hypotheses.

    torchrun --nproc_per_node=4 12_whisper_small_frozen_encoder.py --train data/med_train.jsonl \
        --dev data/med_dev.jsonl --out exp/whisper_small_med
"""
import argparse
import contextlib
import json
import math
import os

import jiwer
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (WhisperFeatureExtractor, WhisperForConditionalGeneration,
                          WhisperTokenizer, get_linear_schedule_with_warmup)
from transformers.models.whisper.english_normalizer import BasicTextNormalizer


class ManifestDataset(Dataset):
    def __init__(self, path, fe, tok, max_dur=30.0):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        self.rows = [r for r in rows if r["duration"] <= max_dur]
        self.fe, self.tok = fe, tok

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        audio, sr = sf.read(r["audio"], dtype="float32")
        assert sr == 16000
        feats = self.fe(audio, sampling_rate=16000, return_tensors="pt").input_features[0]
        ids = self.tok(r["text"]).input_ids
        return feats, ids, r["text"]


class Collate:
    def __init__(self, sot_id):
        self.sot_id = sot_id

    def __call__(self, batch):
        feats, ids, texts = zip(*batch)
        L = max(len(x) for x in ids)
        labels = torch.full((len(ids), L), -100, dtype=torch.long)
        for i, x in enumerate(ids):
            labels[i, : len(x)] = torch.tensor(x)
        if bool((labels[:, 0] == self.sot_id).all()):
            labels = labels[:, 1:]
        return torch.stack(feats), labels, list(texts)


@torch.no_grad()
def transcribe_shard(whisper, loader, tok, device, beams):
    whisper.eval()
    hyps, refs = [], []
    for feats, _, texts in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = whisper.generate(feats.to(device), num_beams=beams, max_new_tokens=200)
        hyps += tok.batch_decode(out, skip_special_tokens=True)
        refs += texts
    whisper.train()
    return hyps, refs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="openai/whisper-small")
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--beams", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    fe = WhisperFeatureExtractor.from_pretrained(args.base)
    tok = WhisperTokenizer.from_pretrained(args.base, language="english", task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.base)
    model.config.use_cache = False
    model.generation_config.language = "english"
    model.generation_config.task = "transcribe"
    # encoder stays fixed; freeze before wrapping so DDP only tracks decoder params
    model.model.encoder.requires_grad_(False)
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)

    collate = Collate(model.config.decoder_start_token_id)
    train_ds = ManifestDataset(args.train, fe, tok)
    dev_ds = ManifestDataset(args.dev, fe, tok)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=32,
                        collate_fn=collate, num_workers=4)

    trainable = [p for p in ddp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.01)
    updates_per_epoch = math.ceil(len(train_dl) / args.accum)
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * updates_per_epoch * args.epochs),
                                            updates_per_epoch * args.epochs)
    norm = BasicTextNormalizer()
    best = float("inf")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for i, (feats, labels, _) in enumerate(train_dl):
            feats, labels = feats.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0 or (i + 1) == len(train_dl)
            ctx = contextlib.nullcontext() if last_micro else ddp.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = ddp(input_features=feats, labels=labels).loss
                (loss / args.accum).backward()
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if rank == 0 and (i // args.accum) % 50 == 0:
                print(f"epoch {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        hyps, refs = transcribe_shard(ddp.module, dev_dl, tok, device, args.beams)
        everything = [None] * world
        dist.all_gather_object(everything, list(zip(hyps, refs)))
        if rank == 0:
            pairs = [p for part in everything for p in part]
            H = [norm(h) for h, _ in pairs]
            R = [norm(r) for _, r in pairs]
            keep = [j for j, r in enumerate(R) if r.strip()]
            score = jiwer.wer([R[j] for j in keep], [H[j] for j in keep])
            print(f"epoch {epoch} dev WER {100 * score:.2f} ({len(keep)} utts)", flush=True)
            ddp.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
            if score < best:
                best = score
                ddp.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
                fe.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
