"""Whisper-small fine-tuning on an in-house English call-center corpus.

Single node, one process per GPU via torch.multiprocessing:
    python 02_whisper_small_spawn.py --train_tsv data/train.tsv --dev_tsv data/dev.tsv \
        --out exp/whisper_small_cc --gpus 4

TSV columns: path<TAB>duration<TAB>transcript
"""
import argparse
import csv
import os
import time

import soundfile as sf
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import WhisperForConditionalGeneration, WhisperProcessor, get_cosine_schedule_with_warmup
from transformers.models.whisper.english_normalizer import BasicTextNormalizer
import jiwer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="openai/whisper-small")
    ap.add_argument("--train_tsv", required=True)
    ap.add_argument("--dev_tsv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", default="29533")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--eval_bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--freeze_encoder", action="store_true")
    ap.add_argument("--max_label_len", type=int, default=440)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def load_tsv(path):
    with open(path, newline="") as f:
        return [(r[0], float(r[1]), r[2]) for r in csv.reader(f, delimiter="\t")]


class WhisperDataset(Dataset):
    def __init__(self, rows, processor, max_label_len):
        self.rows = rows
        self.fe = processor.feature_extractor
        self.tok = processor.tokenizer
        self.max_label_len = max_label_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        wav, sr = sf.read(path, dtype="float32")
        if wav.ndim > 1:
            wav = wav.mean(axis=1)
        feats = self.fe(wav, sampling_rate=sr, return_tensors="pt").input_features[0]
        labels = self.tok(text).input_ids[: self.max_label_len]
        return feats, labels, text


class Collate:
    def __init__(self, pad_id, bos_id):
        self.pad_id = pad_id
        self.bos_id = bos_id

    def __call__(self, batch):
        feats = torch.stack([b[0] for b in batch])
        max_len = max(len(b[1]) for b in batch)
        labels = torch.full((len(batch), max_len), -100, dtype=torch.long)
        for i, (_, lab, _) in enumerate(batch):
            labels[i, : len(lab)] = torch.tensor(lab)
        # the model prepends decoder_start_token itself when shifting labels
        if (labels[:, 0] == self.bos_id).all():
            labels = labels[:, 1:]
        return feats, labels, [b[2] for b in batch]


@torch.no_grad()
def run_eval(model, loader, processor, device, normalizer):
    model.eval()
    err = torch.zeros(2, dtype=torch.float64, device=device)
    for feats, _, refs in loader:
        feats = feats.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            ids = model.generate(input_features=feats, language="en", task="transcribe", max_new_tokens=200)
        hyps = processor.tokenizer.batch_decode(ids, skip_special_tokens=True)
        for ref, hyp in zip(refs, hyps):
            ref_n, hyp_n = normalizer(ref), normalizer(hyp)
            if not ref_n.strip():
                continue
            out = jiwer.process_words(ref_n, hyp_n)
            err[0] += out.substitutions + out.deletions + out.insertions
            err[1] += len(ref_n.split())
    dist.all_reduce(err)
    model.train()
    return (err[0] / err[1].clamp(min=1)).item()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)

    processor = WhisperProcessor.from_pretrained(args.model, language="english", task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.model)
    model.config.forced_decoder_ids = None
    model.generation_config.forced_decoder_ids = None
    if args.freeze_encoder:
        model.model.encoder.requires_grad_(False)
    model.to(device)
    ddp_model = DDP(model, device_ids=[rank])

    train_rows = load_tsv(args.train_tsv)
    dev_rows = sorted(load_tsv(args.dev_tsv), key=lambda r: r[1])
    collate = Collate(processor.tokenizer.pad_token_id, model.config.decoder_start_token_id)
    train_ds = WhisperDataset(train_rows, processor, args.max_label_len)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=17, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(WhisperDataset(dev_rows[rank::world_size], processor, args.max_label_len),
                        batch_size=args.eval_bs, shuffle=False, collate_fn=collate, num_workers=2)

    opt = torch.optim.AdamW((p for p in ddp_model.parameters() if p.requires_grad), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total)
    scaler = torch.cuda.amp.GradScaler()
    normalizer = BasicTextNormalizer()

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    step, best = 0, 1e9
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        for feats, labels, _ in train_dl:
            feats = feats.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ddp_model(input_features=feats, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 100 == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", loss_avg.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                    print(f"ep {epoch} step {step} loss {loss_avg.item():.4f} {time.time() - tic:.1f}s", flush=True)
                tic = time.time()

        wer = run_eval(ddp_model.module, dev_dl, processor, device, normalizer)
        if rank == 0:
            writer.add_scalar("dev/wer", wer, step)
            print(f"epoch {epoch}: dev WER {100 * wer:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": ddp_model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch, "step": step}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if wer < best:
                best = wer
                ddp_model.module.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    n = args.gpus
    mp.spawn(worker, args=(n, args), nprocs=n, join=True)
