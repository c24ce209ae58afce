"""XLS-R 300M CTC fine-tuning for Hindi/Marathi/Tamil (shared grapheme vocab), long utterances.

    torchrun --nproc_per_node=8 16_xlsr_300m_ctc.py --train data/indic/train.jsonl \
        --valid data/indic/valid.jsonl --processor data/indic/processor --out exp/xlsr300m_indic
"""
import argparse
import json
import os
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import Wav2Vec2ForCTC, Wav2Vec2Processor, get_linear_schedule_with_warmup
import jiwer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--processor", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="facebook/wav2vec2-xls-r-300m")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=7.5e-5)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--max_seconds", type=float, default=30.0)
    p.add_argument("--layerdrop", type=float, default=0.05)
    p.add_argument("--save_every", type=int, default=2)
    return p.parse_args()


class IndicASR(Dataset):
    def __init__(self, path, processor, max_seconds=None):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(l) for l in f]
        if max_seconds:
            rows = [r for r in rows if r["duration"] <= max_seconds]
        self.rows, self.processor = rows, processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = sf.read(r["audio_filepath"], dtype="float32")
        if wav.ndim == 2:
            wav = wav.mean(1)
        x = self.processor(wav, sampling_rate=sr).input_values[0]
        y = self.processor.tokenizer(r["text"]).input_ids
        return x, y, r["text"], r.get("lang", "unk")


def collate_with(processor):
    def _collate(batch):
        xs, ys, texts, langs = zip(*batch)
        enc = processor.feature_extractor.pad({"input_values": list(xs)}, return_attention_mask=True,
                                              return_tensors="pt")
        lab = processor.tokenizer.pad({"input_ids": list(ys)}, return_tensors="pt")
        enc["labels"] = lab["input_ids"].masked_fill(lab["attention_mask"] != 1, -100)
        return dict(enc), list(texts), list(langs)
    return _collate


@torch.no_grad()
def validate(model, loader, processor, device, langs=("hi", "mr", "ta")):
    model.eval()
    # per language: [char edits, chars, word edits, words]
    acc = torch.zeros(len(langs), 4, dtype=torch.float64, device=device)
    for batch, refs, ls in loader:
        batch = {k: v.to(device) for k, v in batch.items() if k != "labels"}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        hyps = processor.batch_decode(logits.argmax(-1))
        for ref, hyp, lang in zip(refs, hyps, ls):
            if lang not in langs or not ref.strip():
                continue
            k = langs.index(lang)
            w = jiwer.process_words(ref, hyp)
            c = jiwer.process_characters(ref, hyp)
            acc[k, 0] += c.substitutions + c.deletions + c.insertions
            acc[k, 1] += len(ref)
            acc[k, 2] += w.substitutions + w.deletions + w.insertions
            acc[k, 3] += len(ref.split())
    dist.all_reduce(acc)
    model.train()
    out = {}
    for k, lang in enumerate(langs):
        out[f"{lang}/cer"] = (acc[k, 0] / acc[k, 1].clamp(min=1)).item()
        out[f"{lang}/wer"] = (acc[k, 2] / acc[k, 3].clamp(min=1)).item()
    out["avg/wer"] = float(np.mean([out[f"{l}/wer"] for l in langs]))
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    processor = Wav2Vec2Processor.from_pretrained(args.processor)
    train_set = IndicASR(args.train, processor, args.max_seconds)
    valid_set = IndicASR(args.valid, processor)
    valid_set.rows = sorted(valid_set.rows, key=lambda r: r["duration"])[rank::world]
    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    collate = collate_with(processor)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_set, batch_size=16, collate_fn=collate, num_workers=2)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.model,
        vocab_size=len(processor.tokenizer),
        pad_token_id=processor.tokenizer.pad_token_id,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
        layerdrop=args.layerdrop,
        mask_time_prob=0.05,
        attention_dropout=0.1,
        hidden_dropout=0.1,
        activation_dropout=0.05,
        feat_proj_dropout=0.05,
        final_dropout=0.05,
    )
    model.freeze_feature_encoder()
    # 30 s utterances do not fit otherwise
    model.gradient_checkpointing_enable()
    model.to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            betas=(0.9, 0.98), weight_decay=0.0)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup_steps, total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        processor.save_pretrained(args.out)
        hist = open(os.path.join(args.out, "valid_history.jsonl"), "a")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        losses = []
        for batch, _, _ in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {np.mean(losses[-100:]):.3f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        metrics = validate(model.module, valid_dl, processor, device)
        if rank == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items()), flush=True)
            hist.write(json.dumps({"epoch": epoch, "step": step, **metrics}) + "\n")
            hist.flush()
            if (epoch + 1) % args.save_every == 0 or epoch == args.epochs - 1:
                ck = os.path.join(args.out, f"checkpoint-epoch{epoch}")
                model.module.save_pretrained(ck)
                torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step},
                           os.path.join(ck, "trainer.pt"))
        dist.barrier()

    if rank == 0:
        hist.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
