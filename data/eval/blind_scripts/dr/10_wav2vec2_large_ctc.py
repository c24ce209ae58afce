"""Fine-tune wav2vec2-large (LV-60k) for CTC on Switchboard-style conversational data.

Large model + long utterances, so: gradient checkpointing, fp16, gradient accumulation,
and LayerDrop as in the fairseq recipe.

    torchrun --nproc_per_node=8 10_wav2vec2_large_ctc.py \
        --train data/swbd/train.jsonl --dev data/swbd/rt03.jsonl --processor data/swbd/processor \
        --out exp/w2v2_large_swbd [--resume exp/w2v2_large_swbd/last.pt]
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import Wav2Vec2ForCTC, Wav2Vec2Processor
import jiwer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--processor", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--init", default="facebook/wav2vec2-large-lv60")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--updates", type=int, default=80000)
    ap.add_argument("--layerdrop", type=float, default=0.1)
    ap.add_argument("--max_sec", type=float, default=25.0)
    ap.add_argument("--eval_interval", type=int, default=4000)
    return ap.parse_args()


def load_jsonl(path, max_sec=None):
    out = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if max_sec is None or d["duration"] <= max_sec:
                out.append(d)
    return out


class Utts(Dataset):
    def __init__(self, rows, processor):
        self.rows, self.processor = rows, processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        d = self.rows[i]
        wav, sr = sf.read(d["audio_filepath"], dtype="float32")
        x = self.processor.feature_extractor(wav, sampling_rate=sr).input_values[0]
        y = self.processor.tokenizer(d["text"]).input_ids
        return x, y, d["text"]


def collate(processor):
    def fn(batch):
        xs, ys, refs = zip(*batch)
        enc = processor.feature_extractor.pad({"input_values": list(xs)}, padding=True,
                                              return_attention_mask=True, return_tensors="pt")
        lab = processor.tokenizer.pad({"input_ids": list(ys)}, padding=True, return_tensors="pt")
        enc["labels"] = lab["input_ids"].masked_fill(lab["attention_mask"] == 0, -100)
        return dict(enc), list(refs)
    return fn


class BucketedDistributedBatchSampler(Sampler):
    """Length-bucketed batches, built identically on every rank and then dealt out round-robin.

    The global batch list is cut to a multiple of the world size, so each rank runs the same
    number of steps per epoch."""

    def __init__(self, lengths, batch_size, rank, world, n_buckets=64, seed=0):
        self.lengths, self.batch_size = lengths, batch_size
        self.rank, self.world = rank, world
        self.n_buckets, self.seed, self.epoch = n_buckets, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _global_batches(self):
        g = np.random.default_rng(self.seed + self.epoch)
        order = np.argsort(self.lengths, kind="stable")
        batches = []
        for bucket in np.array_split(order, self.n_buckets):
            bucket = g.permutation(bucket)
            batches += [bucket[i:i + self.batch_size].tolist() for i in range(0, len(bucket), self.batch_size)]
        g.shuffle(batches)
        return batches[: len(batches) // self.world * self.world]

    def __iter__(self):
        return iter(self._global_batches()[self.rank::self.world])

    def __len__(self):
        return len(self._global_batches()) // self.world


def lr_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))
    return f


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    processor = Wav2Vec2Processor.from_pretrained(args.processor)
    train_rows = load_jsonl(args.train, args.max_sec)
    dev_rows = sorted(load_jsonl(args.dev), key=lambda d: d["duration"])

    sampler = BucketedDistributedBatchSampler([d["duration"] for d in train_rows], args.batch, rank, world)
    train_dl = DataLoader(Utts(train_rows, processor), batch_sampler=sampler, collate_fn=collate(processor),
                          num_workers=6, pin_memory=True, persistent_workers=True)
    dev_dl = DataLoader(Utts(dev_rows[rank::world], processor), batch_size=8, collate_fn=collate(processor),
                        num_workers=2)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.init, vocab_size=len(processor.tokenizer), pad_token_id=processor.tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True, layerdrop=args.layerdrop,
        mask_time_prob=0.065, mask_time_length=10, hidden_dropout=0.1, activation_dropout=0.1,
    )
    model.freeze_feature_encoder()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(dev)
    # LayerDrop skips whole transformer layers at random, so some parameters get no grad in a step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=args.layerdrop > 0)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.updates))
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 10)

    updates, epoch = 0, 0
    if args.resume and os.path.isfile(args.resume):
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        updates, epoch = ck["updates"], ck["epoch"]
        if rank == 0:
            print(f"resumed from {args.resume} at update {updates}", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    model.train()
    t0 = time.time()
    while updates < args.updates:
        sampler.set_epoch(epoch)
        n_micro = len(train_dl) // args.accum * args.accum
        for i, (batch, _) in enumerate(train_dl):
            if i >= n_micro:
                break
            batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            boundary = (i + 1) % args.accum == 0
            if boundary:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(**batch).loss / args.accum
                scaler.scale(loss).backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = model(**batch).loss / args.accum
                    scaler.scale(loss).backward()
                continue

            scaler.unscale_(opt)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            updates += 1

            if updates % 100 == 0 and rank == 0:
                print(f"upd {updates} ep {epoch} loss {loss.item() * args.accum:.3f} gnorm {gnorm:.2f} "
                      f"lr {sched.get_last_lr()[0]:.2e} scale {scaler.get_scale():.0f} "
                      f"{(time.time() - t0) / 100:.2f}s/upd", flush=True)
                t0 = time.time()

            if updates % args.eval_interval == 0 or updates == args.updates:
                m = model.module
                m.eval()
                hyps, refs = [], []
                with torch.no_grad():
                    for b, r in dev_dl:
                        b = {k: v.to(dev) for k, v in b.items()}
                        with torch.autocast("cuda", dtype=torch.float16):
                            logits = m(input_values=b["input_values"], attention_mask=b["attention_mask"]).logits
                        hyps += processor.batch_decode(logits.argmax(-1))
                        refs += r
                m.train()
                out = jiwer.process_words(refs, hyps) if refs else None
                c = torch.tensor([out.substitutions + out.deletions + out.insertions if out else 0,
                                  sum(len(x.split()) for x in refs)], dtype=torch.float64, device=dev)
                dist.all_reduce(c)
                wer = (c[0] / c[1]).item()
                if rank == 0:
                    print(f"[eval] update {updates}: WER {100 * wer:.2f}%", flush=True)
                    state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                             "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                             "updates": updates, "epoch": epoch}
                    torch.save(state, os.path.join(args.out, "last.pt.tmp"))
                    os.replace(os.path.join(args.out, "last.pt.tmp"), os.path.join(args.out, "last.pt"))
                    if wer < best:
                        best = wer
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        processor.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()
            if updates >= args.updates:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
