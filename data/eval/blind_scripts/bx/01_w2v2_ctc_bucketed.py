#!/usr/bin/env python3
"""Fine-tune wav2vec2 for character-level CTC on a TSV manifest.

Manifest format (tab separated, one header line):
    path    n_samples    transcript
"""
import argparse
import json
import logging
import os
import random
import time

import editdistance
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import Wav2Vec2ForCTC, get_linear_schedule_with_warmup

logger = logging.getLogger("w2v2_ctc")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_manifest", required=True)
    p.add_argument("--valid_manifest", required=True)
    p.add_argument("--vocab", required=True, help="vocab.json mapping char -> id")
    p.add_argument("--pretrained", default="facebook/wav2vec2-base")
    p.add_argument("--output_dir", default="exp/w2v2_ctc")
    p.add_argument("--max_tokens", type=int, default=1_400_000,
                   help="max audio samples per batch (padded)")
    p.add_argument("--max_sample_len", type=int, default=16000 * 20)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fp16", action="store_true")
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class AudioManifest(Dataset):
    def __init__(self, manifest, vocab, max_len):
        self.items = []
        with open(manifest) as f:
            next(f)
            for line in f:
                path, n, text = line.rstrip("\n").split("\t")
                if int(n) <= max_len:
                    self.items.append((path, int(n), text))
        self.vocab = vocab
        self.unk = vocab["<unk>"]

    def __len__(self):
        return len(self.items)

    def sizes(self):
        return [n for _, n, _ in self.items]

    def encode(self, text):
        text = text.lower().replace(" ", "|")
        return [self.vocab.get(c, self.unk) for c in text]

    def __getitem__(self, idx):
        path, _, text = self.items[idx]
        wav, sr = sf.read(path, dtype="float32")
        assert sr == 16000, f"{path}: expected 16kHz audio, got {sr}"
        if wav.ndim > 1:
            wav = wav.mean(axis=1)
        wav = (wav - wav.mean()) / (wav.std() + 1e-7)
        return torch.from_numpy(wav), torch.tensor(self.encode(text), dtype=torch.long), text


def collate(batch):
    wavs, labels, texts = zip(*batch)
    wav_lens = [w.numel() for w in wavs]
    lab_lens = [l.numel() for l in labels]
    x = torch.zeros(len(wavs), max(wav_lens))
    for i, w in enumerate(wavs):
        x[i, : w.numel()] = w
    y = torch.full((len(labels), max(lab_lens)), -100, dtype=torch.long)
    for i, l in enumerate(labels):
        y[i, : l.numel()] = l
    return x, y, list(texts)


class BucketBatchSampler:
    """Groups utterances of similar length so that each batch holds at most
    max_tokens audio samples, padding included."""

    def __init__(self, sizes, max_tokens, shuffle=True, seed=0):
        self.sizes = np.asarray(sizes)
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.batches = self._make_batches()

    def _make_batches(self):
        order = np.argsort(self.sizes, kind="stable")
        batches, cur, cur_max = [], [], 0
        for idx in order:
            n = int(self.sizes[idx])
            if cur and max(cur_max, n) * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(int(idx))
            cur_max = max(cur_max, n)
        if cur:
            batches.append(cur)
        return batches

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        batches = list(self.batches)
        if self.shuffle:
            rng = random.Random(self.seed + self.epoch)
            rng.shuffle(batches)
        return iter(batches)

    def __len__(self):
        return len(self.batches)


def greedy_decode(logits, id2char, blank_id):
    out = []
    for seq in logits.argmax(dim=-1).cpu():
        seq = torch.unique_consecutive(seq)
        chars = [id2char[int(t)] for t in seq if int(t) != blank_id]
        text = "".join(c for c in chars if not c.startswith("<"))
        out.append(" ".join(text.replace("|", " ").split()))
    return out


@torch.no_grad()
def evaluate(model, loader, id2char, blank_id, device):
    model.eval()
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    for x, _, texts in loader:
        logits = model(x.to(device, non_blocking=True)).logits
        for hyp, ref in zip(greedy_decode(logits, id2char, blank_id), texts):
            ref_words = ref.lower().split()
            stats[0] += editdistance.eval(hyp.split(), ref_words)
            stats[1] += len(ref_words)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s [rank %(process)d] %(levelname)s %(message)s",
    )
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    with open(args.vocab) as f:
        vocab = json.load(f)
    id2char = {v: k for k, v in vocab.items()}
    blank_id = vocab["<pad>"]

    train_ds = AudioManifest(args.train_manifest, vocab, args.max_sample_len)
    valid_ds = AudioManifest(args.valid_manifest, vocab, 10 ** 9)

    train_sampler = BucketBatchSampler(train_ds.sizes(), args.max_tokens, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True)
    # every rank scores a disjoint slice of the dev set, no padding duplicates
    valid_shard = Subset(valid_ds, list(range(rank, len(valid_ds), world_size)))
    valid_loader = DataLoader(valid_shard, batch_size=8, shuffle=False, collate_fn=collate,
                              num_workers=2, pin_memory=True)
    logger.info("train utts=%d batches/epoch=%d | valid utts=%d", len(train_ds),
                len(train_sampler), len(valid_ds))

    model = Wav2Vec2ForCTC.from_pretrained(
        args.pretrained,
        vocab_size=len(vocab),
        pad_token_id=blank_id,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
        mask_time_prob=0.05,
        layerdrop=0.0,
    )
    model.freeze_feature_encoder()
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    total_steps = len(train_sampler) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    best_wer = float("inf")
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for x, y, _ in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(x, labels=y).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1
            running += loss.item()
            if global_step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f gnorm %.2f lr %.2e (%.1fs)",
                            epoch, global_step, running / 100, grad_norm,
                            scheduler.get_last_lr()[0], time.time() - t0)
                running = 0.0

        wer = evaluate(model.module, valid_loader, id2char, blank_id, device)
        logger.info("epoch %d dev WER %.2f%%", epoch, 100 * wer)
        if rank == 0:
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "wer": wer,
            }
            torch.save(state, os.path.join(args.output_dir, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    logger.info("done, best dev WER %.2f%%", 100 * best_wer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
