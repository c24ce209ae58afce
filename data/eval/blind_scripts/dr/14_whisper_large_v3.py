"""Fine-tune whisper-large-v3 on accented English (decoder + cross-attention only, encoder frozen).

    torchrun --nproc_per_node=8 14_whisper_large_v3.py \
        --train_csv data/accented/train.csv --eval_csv data/accented/test.csv --out exp/wlv3_accented

CSV header: path,duration,sentence,accent
"""
import argparse
import csv
import math
import os
import time

import librosa
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoProcessor, WhisperForConditionalGeneration, get_cosine_schedule_with_warmup
from transformers.models.whisper.english_normalizer import EnglishTextNormalizer
import evaluate


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_id", default="openai/whisper-large-v3")
    ap.add_argument("--train_csv", required=True)
    ap.add_argument("--eval_csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--per_gpu_batch", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--eval_every", type=int, default=500)
    return ap.parse_args()


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


class AccentedSpeech(Dataset):
    def __init__(self, rows, processor):
        self.rows, self.processor = rows, processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        audio, _ = librosa.load(r["path"], sr=16000, mono=True)
        feats = self.processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features[0]
        labels = self.processor.tokenizer(r["sentence"]).input_ids
        return feats, labels, r["sentence"], r["accent"]


class PadCollator:
    def __init__(self, start_id):
        self.start_id = start_id

    def __call__(self, batch):
        feats = torch.stack([b[0] for b in batch])
        width = max(len(b[1]) for b in batch)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for i, b in enumerate(batch):
            labels[i, : len(b[1])] = torch.tensor(b[1])
        if bool((labels[:, 0] == self.start_id).all()):
            labels = labels[:, 1:]
        return feats, labels, [b[2] for b in batch], [b[3] for b in batch]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3)

    processor = AutoProcessor.from_pretrained(args.model_id, language="english", task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(
        args.model_id, low_cpu_mem_usage=True, use_safetensors=True, device_map="auto",
    )
    model.config.forced_decoder_ids = None
    model.generation_config.forced_decoder_ids = None
    model.model.encoder.requires_grad_(False)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model = DDP(model, device_ids=[local_rank])

    train_ds = AccentedSpeech(read_csv(args.train_csv), processor)
    eval_rows = sorted(read_csv(args.eval_csv), key=lambda r: float(r["duration"]))
    eval_ds = AccentedSpeech(eval_rows[rank::world], processor)
    collator = PadCollator(model.module.config.decoder_start_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=3, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.per_gpu_batch, sampler=sampler, collate_fn=collator,
                          num_workers=6, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=8, collate_fn=collator, num_workers=2)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    updates_per_epoch = len(train_dl) // args.grad_accum
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, updates_per_epoch * args.epochs)
    normalizer = EnglishTextNormalizer(processor.tokenizer.english_spelling_normalizer)
    wer_metric = evaluate.load("wer")

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)
        print(f"trainable params: {n_train / 1e6:.1f}M, world size {world}", flush=True)

    def run_eval():
        m = model.module
        m.eval()
        errs = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for feats, _, refs, _ in eval_dl:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    ids = m.generate(input_features=feats.to(device), language="en", task="transcribe",
                                     max_new_tokens=128)
                hyps = processor.batch_decode(ids, skip_special_tokens=True)
                for ref, hyp in zip(refs, hyps):
                    ref, hyp = normalizer(ref), normalizer(hyp)
                    if ref:
                        n = len(ref.split())
                        errs[0] += wer_metric.compute(references=[ref], predictions=[hyp]) * n
                        errs[1] += n
        dist.all_reduce(errs)
        m.train()
        return (errs[0] / errs[1]).item()

    update, t0 = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (feats, labels, _, _) in enumerate(train_dl):
            if i >= updates_per_epoch * args.grad_accum:
                break
            feats, labels = feats.to(device), labels.to(device)
            step_now = (i + 1) % args.grad_accum == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if step_now:
                    loss = model(input_features=feats, labels=labels).loss / args.grad_accum
                    loss.backward()
                else:
                    with model.no_sync():
                        loss = model(input_features=feats, labels=labels).loss / args.grad_accum
                        loss.backward()
            if not step_now:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1
            if writer is not None and update % 20 == 0:
                writer.add_scalar("train/loss", loss.item() * args.grad_accum, update)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], update)
                print(f"ep {epoch} upd {update} loss {loss.item() * args.grad_accum:.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)
            if update % args.eval_every == 0:
                wer = run_eval()
                if rank == 0:
                    writer.add_scalar("eval/wer", wer, update)
                    print(f"eval @ {update}: WER {100 * wer:.2f}", flush=True)
                    model.module.save_pretrained(os.path.join(args.out, f"checkpoint-{update}"),
                                                 safe_serialization=True)
                dist.barrier()

    wer = run_eval()
    if rank == 0:
        print(f"final WER {100 * wer:.2f}", flush=True)
        model.module.save_pretrained(os.path.join(args.out, "final"))
        processor.save_pretrained(os.path.join(args.out, "final"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
