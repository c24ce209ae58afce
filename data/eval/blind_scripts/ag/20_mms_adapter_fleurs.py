"""Train an MMS-1B language adapter (CTC) on FLEURS with DDP.

torchrun --nproc_per_node=4 20_mms_adapter_fleurs.py --lang yor --fleurs_lang yo_ng --output_dir out/mms_yor
"""
import argparse
import json
import os
import re

import torch
import torch.distributed as dist
from datasets import Audio, load_dataset
from safetensors.torch import save_file as safe_save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, Wav2Vec2CTCTokenizer, Wav2Vec2ForCTC
from transformers.models.wav2vec2.modeling_wav2vec2 import WAV2VEC2_ADAPTER_SAFE_FILE
import jiwer

CHARS_TO_REMOVE = re.compile(r"[\,\?\.\!\-\;\:\"\“\%\‘\”\�\'\»\«]")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="facebook/mms-1b-all")
    ap.add_argument("--lang", required=True, help="MMS / ISO 639-3 code used for the adapter")
    ap.add_argument("--fleurs_lang", required=True, help="google/fleurs config name")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--vocab_file", default=None, help="vocab.json written by prepare_vocab.py")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--eval_every", type=int, default=200)
    return ap.parse_args()


def normalize(text):
    return CHARS_TO_REMOVE.sub("", text).lower()


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    vocab_file = args.vocab_file or os.path.join(args.output_dir, "vocab.json")
    tokenizer = Wav2Vec2CTCTokenizer(vocab_file, unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|",
                                     target_lang=args.lang)
    processor = AutoProcessor.from_pretrained(args.base)
    processor.tokenizer = tokenizer

    if rank == 0:
        load_dataset("google/fleurs", args.fleurs_lang)  # populate the HF cache once
    dist.barrier()
    ds = load_dataset("google/fleurs", args.fleurs_lang)
    ds = ds.cast_column("audio", Audio(sampling_rate=16000))
    train_ds, dev_ds = ds["train"], ds["validation"]

    def collate(rows):
        audio = [r["audio"]["array"] for r in rows]
        text = [normalize(r["transcription"]) for r in rows]
        batch = processor(audio=audio, sampling_rate=16000, padding=True, return_tensors="pt")
        labels = processor.tokenizer(text, padding=True, return_tensors="pt")
        batch["labels"] = labels.input_ids.masked_fill(labels.attention_mask.ne(1), -100)
        batch["text"] = text
        return batch

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=16, sampler=dev_sampler, collate_fn=collate, num_workers=4)

    model = Wav2Vec2ForCTC.from_pretrained(args.base, attention_dropout=0.0, hidden_dropout=0.0,
                                           feat_proj_dropout=0.0, layerdrop=0.0, ctc_loss_reduction="mean",
                                           pad_token_id=processor.tokenizer.pad_token_id,
                                           vocab_size=len(processor.tokenizer), ignore_mismatched_sizes=True)
    model.init_adapter_layers()
    model.freeze_base_model()
    for p in model._get_adapters().values():
        p.requires_grad = True
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    trainable = [p for p in model.parameters() if p.requires_grad]
    if rank == 0:
        print(f"trainable params: {sum(p.numel() for p in trainable) / 1e6:.2f}M", flush=True)
    opt = torch.optim.AdamW(trainable, lr=args.lr)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.1)

    def evaluate():
        model.eval()
        refs, hyps = [], []
        with torch.no_grad():
            for batch in dev_loader:
                logits = model.module(batch["input_values"].to(device),
                                      attention_mask=batch["attention_mask"].to(device)).logits
                hyps += processor.batch_decode(logits.argmax(-1))
                refs += batch["text"]
        model.train()
        return jiwer.wer(refs, hyps), jiwer.cer(refs, hyps)

    best_cer = float("inf")
    step = 0
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_values=batch["input_values"].to(device),
                            attention_mask=batch["attention_mask"].to(device),
                            labels=batch["labels"].to(device))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {out.loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

            if step % args.eval_every == 0 or step == total:
                wer, cer = evaluate()
                if rank == 0:
                    print(f"step {step}: dev WER {wer * 100:.2f} CER {cer * 100:.2f}", flush=True)
                    if cer < best_cer:
                        best_cer = cer
                        os.makedirs(args.output_dir, exist_ok=True)
                        adapter_file = os.path.join(args.output_dir,
                                                    WAV2VEC2_ADAPTER_SAFE_FILE.format(args.lang))
                        safe_save_file(model.module._get_adapters(), adapter_file, metadata={"format": "pt"})
                        processor.save_pretrained(args.output_dir)
                        with open(os.path.join(args.output_dir, "best.json"), "w") as f:
                            json.dump({"step": step, "wer": wer, "cer": cer}, f)
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
