"""FastPitch on a multilingual character inventory (de/fr/es/it CSS10 + LJSpeech).

Characters are taken straight from the normalised transcripts instead of a fixed symbol table,
so new languages need no code change. Durations come from the aligner dump (durations/*.pt),
pitch from pitch/*.pt.

    torchrun --nproc_per_node=8 11_fastpitch_multilingual.py --filelists data/ml_train.txt data/ml_val.txt
"""
import argparse
import json
import os
import time
import unicodedata

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from fastpitch.loss_function import FastPitchLoss
from fastpitch.model import FastPitch

PAD, EOS = "_", "~"


def normalize(text):
    return unicodedata.normalize("NFC", text.strip().lower())


def read_filelist(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            wav, lang, text = line.rstrip("\n").split("|")
            rows.append((wav, lang, normalize(text)))
    return rows


def build_symbols(rows):
    chars = set()
    for _, _, text in rows:
        chars.update(text)
    chars.discard(PAD)
    chars.discard(EOS)
    return [PAD, EOS] + list(chars)


class MultilingualTTSData(Dataset):
    def __init__(self, rows, symbol_to_id, lang_to_id, feat_root):
        self.rows = rows
        self.symbol_to_id = symbol_to_id
        self.lang_to_id = lang_to_id
        self.feat_root = feat_root

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        wav, lang, text = self.rows[i]
        stem = os.path.splitext(os.path.basename(wav))[0]
        ids = torch.LongTensor([self.symbol_to_id[c] for c in text if c in self.symbol_to_id]
                               + [self.symbol_to_id[EOS]])
        mel = torch.load(os.path.join(self.feat_root, "mels", stem + ".pt"))          # (80, T)
        dur = torch.load(os.path.join(self.feat_root, "durations", stem + ".pt"))     # (N,)
        pitch = torch.load(os.path.join(self.feat_root, "pitch", stem + ".pt"))       # (1, N)
        return ids, mel, dur, pitch, self.lang_to_id[lang]


def collate(batch):
    batch = sorted(batch, key=lambda b: b[0].numel(), reverse=True)
    in_lens = torch.LongTensor([b[0].numel() for b in batch])
    out_lens = torch.LongTensor([b[1].size(1) for b in batch])
    B, max_in, max_out = len(batch), int(in_lens.max()), int(out_lens.max())
    text = torch.zeros(B, max_in, dtype=torch.long)
    mel = torch.zeros(B, batch[0][1].size(0), max_out)
    dur = torch.zeros(B, max_in, dtype=torch.long)
    pitch = torch.zeros(B, 1, max_in)
    for i, (ids, m, d, p, _) in enumerate(batch):
        text[i, :ids.numel()] = ids
        mel[i, :, :m.size(1)] = m
        dur[i, :d.numel()] = d
        pitch[i, :, :p.size(1)] = p
    lang = torch.LongTensor([b[4] for b in batch])
    return text, in_lens, mel, out_lens, dur, pitch, lang


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--filelists", nargs=2, required=True, metavar=("TRAIN", "VAL"))
    ap.add_argument("--feat_root", default="data/feats")
    ap.add_argument("--out_dir", default="runs/fastpitch_ml")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--save_every", type=int, default=50)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_rows = read_filelist(args.filelists[0])
    val_rows = read_filelist(args.filelists[1])
    symbols = build_symbols(train_rows + val_rows)
    symbol_to_id = {s: i for i, s in enumerate(symbols)}
    langs = sorted({r[1] for r in train_rows})
    lang_to_id = {l: i for i, l in enumerate(langs)}
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "symbols.json"), "w", encoding="utf-8") as f:
            json.dump({"symbols": symbols, "languages": langs}, f, ensure_ascii=False, indent=1)

    train_set = MultilingualTTSData(train_rows, symbol_to_id, lang_to_id, args.feat_root)
    val_set = MultilingualTTSData(val_rows, symbol_to_id, lang_to_id, args.feat_root)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, collate_fn=collate, num_workers=2)

    model = FastPitch(n_symbols=len(symbols), n_speakers=len(langs), n_mel_channels=80,
                      symbols_embedding_dim=384, in_fft_n_layers=6, out_fft_n_layers=6).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = FastPitchLoss(dur_predictor_loss_scale=0.1, pitch_predictor_loss_scale=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5))
    writer = SummaryWriter(args.out_dir) if rank == 0 else None
    amp_dtype = torch.bfloat16 if args.bf16 else torch.float16
    scaler = torch.cuda.amp.GradScaler(enabled=not args.bf16)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for text, in_lens, mel, out_lens, dur, pitch, lang in train_loader:
            text, in_lens = text.to(device, non_blocking=True), in_lens.to(device, non_blocking=True)
            mel, out_lens = mel.to(device, non_blocking=True), out_lens.to(device, non_blocking=True)
            dur, pitch, lang = dur.to(device), pitch.to(device), lang.to(device)
            with torch.autocast("cuda", dtype=amp_dtype):
                out = model((text, in_lens, mel, out_lens, pitch, None, lang, dur), use_gt_pitch=True)
                loss, meta = criterion(out, (mel, dur, out_lens, pitch, None))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            if step % 50 == 0:
                log_vals = torch.stack([meta["mel_loss"], meta["duration_predictor_loss"],
                                        meta["pitch_loss"]]).detach()
                dist.all_reduce(log_vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    for k, v in zip(["mel", "dur", "pitch"], log_vals.tolist()):
                        writer.add_scalar(f"train/{k}", v, step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

        if rank == 0:
            model.module.eval()
            tot, n = 0.0, 0
            with torch.no_grad():
                for text, in_lens, mel, out_lens, dur, pitch, lang in val_loader:
                    batch = [t.to(device) for t in (text, in_lens, mel, out_lens, dur, pitch, lang)]
                    text, in_lens, mel, out_lens, dur, pitch, lang = batch
                    out = model.module((text, in_lens, mel, out_lens, pitch, None, lang, dur), use_gt_pitch=True)
                    _, meta = criterion(out, (mel, dur, out_lens, pitch, None))
                    tot += meta["mel_loss"].item() * text.size(0)
                    n += text.size(0)
            model.module.train()
            writer.add_scalar("val/mel", tot / max(n, 1), step)
            print(f"epoch {epoch} step {step} val mel {tot / max(n, 1):.4f} ({time.time() - t0:.0f}s)", flush=True)
            if (epoch + 1) % args.save_every == 0:
                torch.save({"state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "symbols": symbols, "languages": langs, "epoch": epoch, "step": step},
                           os.path.join(args.out_dir, f"FastPitch_checkpoint_{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
