"""Whisper-small fine-tuning on Common Voice (de) with a plain PyTorch DDP loop.

torchrun --nproc_per_node=8 04_whisper_small_finetune.py --output_dir runs/whisper-small-de
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import Audio, load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import WhisperForConditionalGeneration, WhisperProcessor, get_cosine_schedule_with_warmup
from transformers.models.whisper.english_normalizer import BasicTextNormalizer
import jiwer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="openai/whisper-small")
    ap.add_argument("--dataset", default="mozilla-foundation/common_voice_13_0")
    ap.add_argument("--language", default="de")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--eval_batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--max_steps", type=int, default=5000)
    ap.add_argument("--eval_steps", type=int, default=1000)
    ap.add_argument("--max_eval_samples", type=int, default=2000)
    ap.add_argument("--num_workers", type=int, default=4)
    return ap.parse_args()


class WhisperCollator:
    def __init__(self, processor, decoder_start_token_id):
        self.processor = processor
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, rows):
        audio = [r["audio"]["array"] for r in rows]
        feats = self.processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
        labels = self.processor.tokenizer([r["sentence"] for r in rows], padding=True, return_tensors="pt")
        label_ids = labels.input_ids.masked_fill(labels.attention_mask.ne(1), -100)
        # the model prepends the start token itself when building decoder_input_ids
        if (label_ids[:, 0] == self.decoder_start_token_id).all():
            label_ids = label_ids[:, 1:]
        return {"input_features": feats, "labels": label_ids, "sentence": [r["sentence"] for r in rows]}


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    processor = WhisperProcessor.from_pretrained(args.model, language="german", task="transcribe")
    normalizer = BasicTextNormalizer()

    # download/prepare once on rank 0, the others read the cache afterwards
    if not is_main:
        dist.barrier()
    train_ds = load_dataset(args.dataset, args.language, split="train+validation")
    test_ds = load_dataset(args.dataset, args.language, split="test")
    if is_main:
        dist.barrier()
    train_ds = train_ds.cast_column("audio", Audio(sampling_rate=16000))
    test_ds = test_ds.cast_column("audio", Audio(sampling_rate=16000))
    test_ds = test_ds.select(range(min(args.max_eval_samples, len(test_ds))))
    train_ds = train_ds.remove_columns([c for c in train_ds.column_names if c not in ("audio", "sentence")])
    test_ds = test_ds.remove_columns([c for c in test_ds.column_names if c not in ("audio", "sentence")])

    model = WhisperForConditionalGeneration.from_pretrained(args.model)
    model.config.forced_decoder_ids = None
    model.config.suppress_tokens = []
    model.generation_config.language = "german"
    model.generation_config.task = "transcribe"
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    collator = WhisperCollator(processor, model.module.config.decoder_start_token_id)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=args.num_workers, drop_last=True)
    # each rank scores its own contiguous slice of the test set, no padded duplicates
    test_shard = test_ds.shard(num_shards=world, index=rank, contiguous=True)
    test_loader = DataLoader(test_shard, batch_size=args.eval_batch_size, shuffle=False,
                             collate_fn=collator, num_workers=args.num_workers)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim == 1 or "layer_norm" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.max_steps)

    def evaluate(step):
        model.eval()
        err = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for batch in test_loader:
                feats = batch["input_features"].to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred_ids = model.generate(input_features=feats, max_new_tokens=128)
                preds = processor.batch_decode(pred_ids, skip_special_tokens=True)
                for ref, hyp in zip(batch["sentence"], preds):
                    ref, hyp = normalizer(ref), normalizer(hyp)
                    if not ref.strip():
                        continue
                    o = jiwer.process_words(ref, hyp)
                    err[0] += o.substitutions + o.deletions + o.insertions
                    err[1] += len(ref.split())
        dist.all_reduce(err)
        wer = (err[0] / err[1]).item() * 100
        if is_main:
            print(f"[step {step}] test WER {wer:.2f}", flush=True)
        model.train()
        return wer

    step, epoch = 0, 0
    best = math.inf
    model.train()
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            feats = batch["input_features"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_features=feats, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if is_main and step % 25 == 0:
                el = time.time() - t0
                print(f"step {step}/{args.max_steps} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {el / step:.2f}s/it", flush=True)

            if step % args.eval_steps == 0 or step == args.max_steps:
                wer = evaluate(step)
                if is_main and wer < best:
                    best = wer
                    model.module.save_pretrained(args.output_dir)
                    processor.save_pretrained(args.output_dir)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
