"""
CTC fine-tuning of wav2vec2-large (XLS-R 300M) for the pt-BR in-car voice assistant.

Kubeflow PyTorchJob, single Master pod with 8x A10G (g5.48xlarge); the pod command is

    torchrun --standalone --nproc_per_node=8 train_w2v2_ctc.py \
        --train-csv /data/ptbr/train.csv --dev-csv /data/ptbr/dev.csv \
        --vocab /data/ptbr/vocab.json --output-dir /mnt/artifacts/w2v2-ptbr-car \
        --fp16 --epochs 30

CSV columns: path,duration,transcript.  TensorBoard logs are synced to S3 by a sidecar.
"""
import argparse
import csv
import math
import os
import re

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn.functional as F
from jiwer import wer as jiwer_wer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from transformers import Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC, Wav2Vec2Processor

CHARS_TO_IGNORE = re.compile(r"[\,\?\.\!\-\;\:\"\“\%\‘\”\�\']")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="facebook/wav2vec2-xls-r-300m")
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--dev-csv", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--max-seconds", type=float, default=16.0)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--local_rank", type=int, default=0)
    return ap.parse_args()


class CsvSpeech(Dataset):
    def __init__(self, path, processor, max_seconds):
        with open(path) as f:
            rows = list(csv.DictReader(f))
        self.rows = [r for r in rows if float(r["duration"]) <= max_seconds]
        self.proc = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        audio, sr = sf.read(r["path"], dtype="float32")
        assert sr == 16000, r["path"]
        x = self.proc.feature_extractor(audio, sampling_rate=sr).input_values[0]
        text = CHARS_TO_IGNORE.sub("", r["transcript"]).lower()
        y = self.proc.tokenizer(text).input_ids
        return torch.tensor(x), torch.tensor(y)


def collate(batch):
    xs, ys = zip(*batch)
    x_len = torch.tensor([len(x) for x in xs])
    x = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    attn = (torch.arange(x.size(1))[None, :] < x_len[:, None]).long()
    y = torch.nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-100)
    return x, attn, y


def lr_factor(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


@torch.no_grad()
def dev_wer(model, loader, processor, device):
    model.eval()
    hyps, refs = [], []
    for x, attn, y in loader:
        logits = model.module(x.to(device), attention_mask=attn.to(device)).logits
        pred = logits.argmax(-1)
        hyps += processor.batch_decode(pred)
        y[y == -100] = processor.tokenizer.pad_token_id
        refs += processor.batch_decode(y, group_tokens=False)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (hyps, refs))
    model.train()
    H = [h for o in out for h in o[0]]
    R = [r for o in out for r in o[1]]
    return jiwer_wer(R, H)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    tokenizer = Wav2Vec2CTCTokenizer(args.vocab, unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|")
    fe = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                  do_normalize=True, return_attention_mask=True)
    processor = Wav2Vec2Processor(feature_extractor=fe, tokenizer=tokenizer)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.model, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True,
        attention_dropout=0.0, hidden_dropout=0.0, feat_proj_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.05,
    )
    model.freeze_feature_encoder()
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    train_ds = CsvSpeech(args.train_csv, processor, args.max_seconds)
    dev_ds = CsvSpeech(args.dev_csv, processor, 30.0)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=8,
                        collate_fn=collate, num_workers=4)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.005)
    total = args.epochs * len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.warmup, total))
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    tb = SummaryWriter(os.path.join(args.output_dir, "runs")) if rank == 0 else None
    best = math.inf
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, attn, y) in enumerate(train_dl):
            x, attn, y = x.to(device, non_blocking=True), attn.to(device, non_blocking=True), y.to(device, non_blocking=True)
            do_step = (i + 1) % args.accum == 0
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                if do_step:
                    loss = model(x, attention_mask=attn, labels=y).loss / args.accum
                    scaler.scale(loss).backward()
                else:
                    with model.no_sync():
                        loss = model(x, attention_mask=attn, labels=y).loss / args.accum
                        scaler.scale(loss).backward()
            if not do_step:
                continue
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if tb is not None and step % 25 == 0:
                tb.add_scalar("train/loss", loss.item() * args.accum, step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)
                tb.add_scalar("train/scale", scaler.get_scale(), step)

        w = dev_wer(model, dev_dl, processor, device)
        if rank == 0:
            tb.add_scalar("dev/wer", w, step)
            print(f"epoch {epoch}: dev WER {w:.4f}", flush=True)
            if w < best:
                best = w
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
